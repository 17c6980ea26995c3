"""The estimator's input checked as scikit-learn checks every estimator's, before the library's own checks
(``data.dataset``): array-likes made 2-D float arrays of the fitted width, and noise passed as ``y`` refused."""

from __future__ import annotations

import numpy as np
import torch
from scipy.sparse import issparse
from sklearn.utils.validation import check_array, validate_data

from .data.iterable import is_batch_iterable
from .data.noise import CompactCovariance
from .data.source import DataSource


def checked_input(estimator, X, y, R, sample_weight, method: str, reset: bool):
    """(X, sample_weight) for ``estimator`` (an ``XDGMM``) checked as scikit-learn checks every estimator's
    input, where X is array-like (an array, a DataFrame, nested lists, a sparse matrix): 2-D, numeric,
    real, dense and not empty, of
    the fitted number of features (``reset``: this call sets it, and ``feature_names_in_`` from a
    DataFrame) where no R projects it; ``sample_weight`` an array. Our own checks (rows named, noise
    checked) follow in ``Dataset``. Tensors, sources and iterables of batches keep their own checks.
    A y with the shape of noise covariances is refused (``refuse_noise_as_y``)."""
    refuse_noise_as_y(y, method)
    if isinstance(X, (list, tuple)) and len(X) == 0:  # scikit-learn's advice to reshape would not apply
        raise ValueError(f"{method}: X is empty: give at least one row of n_features values")
    if not array_like(X):
        if reset:
            estimator.__dict__.pop("feature_names_in_", None)  # not from this fit's data
        return X, sample_weight
    # float16 kept for Dataset to warn of its precision; Dataset names a non-finite row
    check = dict(dtype=(np.float64, np.float32, np.float16), ensure_all_finite=False)
    # R maps the model onto data of any number of features: the count is checked only without it
    try:
        if reset or (R is None and getattr(estimator, "n_features_in_", None) == estimator._fitted().dim):
            X = validate_data(estimator, X, reset=reset, **check)
        else:
            X = check_array(X, input_name="X", estimator=estimator, **check)
    except ValueError as err:
        raise _named(_without_values(err, X), X, method) from None
    if sample_weight is not None:  # Dataset checks its length and names a NaN, negative or all-zero row
        sample_weight = check_array(
            sample_weight, input_name="sample_weight", ensure_2d=False, dtype=np.float64, ensure_all_finite=False
        )
    return X, sample_weight


def array_like(X) -> bool:
    """Whether X is input scikit-learn's ``check_array`` reads, rather than a tensor, a data source or an
    iterable of batches."""
    if isinstance(X, (torch.Tensor, DataSource)):
        return False
    return issparse(X) or hasattr(X, "__array__") or (isinstance(X, (list, tuple)) and not is_batch_iterable(X))


def refuse_noise_as_y(y, method: str) -> None:
    """``y`` is ignored, as by every unsupervised scikit-learn estimator; but astroML's and Holoien's
    ``XDGMM`` take the noise second (``fit(X, Xerr)``), and noise silently ignored would make a wrong
    model: a y of two or three dimensions (or a ``CompactCovariance``) is refused."""
    if y is None:
        return
    shape = None if isinstance(y, CompactCovariance) else np.asarray(y).shape
    if shape is None or len(shape) >= 2:
        what = "a CompactCovariance" if shape is None else f"of shape {shape}"
        raise ValueError(
            f"{method}: the second argument is y, which XDGMM ignores (scikit-learn's convention), and it is "
            f"{what}, noise covariances' shape: pass the noise by name, {method}(X, Xcov=...)"
        )


def _named(err: ValueError, X, method: str) -> ValueError:
    """scikit-learn's and numpy's errors for complex or non-numeric X, which print the array or the bad value
    alone, made to name X and the row and column (a DataFrame's column by its name)."""
    message = str(err)
    if message.startswith("Complex data not supported"):
        dtype = getattr(X, "dtype", None) or np.asarray(X).dtype
        return ValueError(  # scikit-learn's words kept: its estimator checks look for them
            f"{method}: Complex data not supported: X is complex ({dtype}); XD fits real features: give the real and "
            "imaginary parts as two features, or the real part alone"
        )
    if not message.startswith("could not convert"):
        return err
    columns = list(X.columns) if hasattr(X, "columns") else None
    cells = np.asarray(X, dtype=object)
    for (row, column), value in np.ndenumerate(cells.reshape(len(cells), -1)):
        try:
            float(value)
        except (TypeError, ValueError):
            name = f"column {column}" if columns is None else f"column {columns[column]!r}"
            return ValueError(f"{method}: X row {row}, {name} is {value!r}, not a number")
    return err


def _without_values(err: ValueError, X) -> ValueError:
    """scikit-learn's error for a 1-D X, its words kept but not the array it prints (every value of a
    catalogue up to numpy's 1,000, a summary beyond): its shape instead."""
    message = str(err)
    if not message.startswith("Expected 2D array, got 1D array instead") or "array=" not in message:
        return err
    head, _, tail = message.partition("array=")
    advice = tail[tail.find("Reshape your data") :] if "Reshape your data" in tail else ""
    return ValueError(f"{head.rstrip().rstrip(':')} (X of shape {np.shape(X)}). {advice}".strip())

"""The data a fit is given, validated: arrays, iterables of batches and streamed sources become a
``DataSource`` whose rows, noise and weights were checked, of the training data's dimensions (validation
and monitored sets) and within the fit's dtype's range; or a ValueError naming the argument."""

from __future__ import annotations

from torch.utils.data import Dataset as TorchDataset

from .._torch import resolve_dtype
from ..settings import FitSettings
from .dataset import Dataset
from .iterable import IterableSource, is_batch_iterable
from .source import DataSource


def data_source(X, Xcov, R, sample_weight, name: str, missing: str) -> DataSource:
    """Arrays as a validated ``Dataset``; an iterable of batches as an ``IterableSource`` (opened with a
    checking pass); any other ``DataSource`` (a ``ParquetSource``, a user's own) as it is."""
    if is_batch_iterable(X):
        _refuse_beside(X, name, "an iterable of batches", Xcov=Xcov, R=R, sample_weight=sample_weight)
        return IterableSource(X, name=name, missing=missing)
    map_style = hasattr(X, "__getitem__") and hasattr(X, "__len__") and not hasattr(X, "__iter__")
    if isinstance(X, TorchDataset) or (map_style and not hasattr(X, "__array__")):  # one point per index
        kind = "a torch Dataset" if isinstance(X, TorchDataset) else f"a {type(X).__name__} (__getitem__ and __len__)"
        raise ValueError(
            f"{name} is {kind}, which gives one point at a time: give a DataLoader over it "
            "(DataLoader(dataset, batch_size=500)), whose (X, Xcov) batches the fit reads"
        )
    if not isinstance(X, DataSource):
        return Dataset(X, Xcov, R, sample_weight=sample_weight, name=name, missing=missing)
    kind = f"a {type(X).__name__}"
    if X.missing != missing:
        raise ValueError(
            f"{name} is {kind} opened with missing={X.missing!r}, but the model's missing is {missing!r}: "
            f"open it with missing={missing!r}"
        )
    _refuse_beside(X, name, kind, Xcov=Xcov, R=R, sample_weight=sample_weight)
    return X


def _refuse_beside(X, name: str, kind: str, **arrays) -> None:
    """A source carries its own noise (and weights): refuse the arrays given beside it, naming them."""
    given = [arg for arg, value in arrays.items() if value is not None]
    if given:
        raise ValueError(
            f"{name} is {kind}, which carries its own noise (and weights): {', '.join(given)} cannot be given with it"
        )


def training_data(X, Xcov, R, X_val, Xcov_val, R_val, sample_weight, n_components: int, settings: FitSettings):
    """The validated training and validation sets (in memory, or streamed sources)."""
    train = training_source(X, Xcov, R, sample_weight, settings, n_components)
    val = None
    if X_val is not None:
        val = _scored_beside(X_val, Xcov_val, R_val, "X_val", "X_val (and R_val)", train, settings)
    return train, val


def training_source(X, Xcov, R, sample_weight, settings: FitSettings, n_components: int | None = None) -> DataSource:
    """X with its noise, projections and weights as validated training data within the fit's dtype's range;
    with ``n_components``, holding at least that many points (as k-means needs)."""
    train = data_source(X, Xcov, R, sample_weight, "X", settings.missing)
    train.check_range(resolve_dtype(settings.dtype))
    if n_components is not None and n_components > len(train):
        raise ValueError(f"n_components={n_components} is larger than the number of points ({len(train)})")
    return train


def _scored_beside(X, Xcov, R, name: str, subject: str, train, settings: FitSettings):
    """Data scored beside the fit (validation data, ``eval_sets``), validated as ``name``: of ``train``'s
    dimensions (else a ValueError naming ``subject``) and within the fit's dtype's range."""
    data = data_source(X, Xcov, R, None, name, settings.missing)
    if data.obs_dim != train.obs_dim or data.model_dim != train.model_dim:
        raise ValueError(f"{subject} must have the same dimensions as X (and R)")
    data.check_range(resolve_dtype(settings.dtype), name)
    return data


def monitored_data(eval_sets, train, settings: FitSettings) -> dict:
    """``eval_sets`` ({name: (X, Xcov) or (X, Xcov, R)}) as validated data sets of ``train``'s dimensions,
    or a ValueError naming the set."""
    if eval_sets is None:
        return {}
    if not isinstance(eval_sets, dict):
        raise ValueError(f"eval_sets must be a dict of name: (X, Xcov) or (X, Xcov, R), got {type(eval_sets).__name__}")
    monitored = {}
    for name, arrays in eval_sets.items():
        if not isinstance(name, str) or not name.isidentifier() or name in ("train", "val"):
            raise ValueError(f"eval_sets: {name!r} is not a usable name (an identifier other than train and val)")
        if not isinstance(arrays, (tuple, list)) or len(arrays) not in (2, 3):
            raise ValueError(f"eval_sets[{name!r}] must be a tuple (X, Xcov) or (X, Xcov, R)")
        X, Xcov, R = (*arrays, None)[:3]
        label = f"eval_sets[{name!r}]"
        monitored[name] = _scored_beside(X, Xcov, R, label, label, train, settings)
    return monitored

"""Inputs that used to fail inside torch or return non-finite numbers now fail up front, naming the culprit."""

import numpy as np
import pandas as pd
import pytest

from scalable_xd import XDGMM
from scalable_xd.data.batching import epoch_order
from scalable_xd.fit.families.minibatch_em import MinibatchEM
from scalable_xd.fit.families.sgd import SGD

RNG = np.random.default_rng(0)
X = RNG.normal(size=(200, 2))


@pytest.fixture(scope="module")
def fitted():
    return XDGMM(2, epochs=2, device="cpu", random_state=0).fit(X)


@pytest.mark.parametrize("scale, dtype, row", [(1e30, "float32", 0), (1e20, "float32", 0), (1e160, "float64", 0)])
def test_values_whose_squares_overflow_are_refused(scale, dtype, row):
    x = X.copy()
    x[5:] *= scale
    x[:5] = 0.0  # the first overflowing row is 5
    with pytest.raises(ValueError, match=f"X row 5, column \\d has a value beyond .*, whose squares overflow {dtype}"):
        XDGMM(2, epochs=1, device="cpu", dtype=dtype).fit(x)


def test_float32_suggests_float64_and_float64_fits_what_float32_cannot():
    with pytest.raises(ValueError, match="fit in float64 or rescale the features"):
        XDGMM(2, epochs=1, device="cpu").fit(X * 1e30)
    settings = dict(epochs=3, device="cpu", dtype="float64", random_state=0, w=0.0)
    model = XDGMM(2, covariances_init=np.stack([np.eye(2) * 1e60] * 2), **settings).fit(X * 1e30)
    unit = XDGMM(2, covariances_init=np.stack([np.eye(2)] * 2), **settings).fit(X)
    # without regularisation, a change of units shifts log p by -D log(scale) and nothing else
    assert model.score(X * 1e30) == pytest.approx(unit.score(X) - 2 * np.log(1e30), rel=1e-9)


def test_scoring_out_of_range_data_is_refused_not_minus_infinity(fitted):
    with pytest.raises(ValueError, match=r"X row 0, column \d has a value beyond"):
        fitted.score(X * 1e30)
    with pytest.raises(ValueError, match=r"the noise covariance of X row 3, entry \(0, 0\) has an entry beyond"):
        fitted.score(X, Xcov=np.where(np.arange(200)[:, None] == 3, 1e40, 0.1) * np.ones((200, 2)))


@pytest.mark.parametrize(
    "make, message",
    [
        # scikit-learn's words (its check_array reads array input first), then ours, naming the row and column
        (lambda: np.zeros((10, 0)), r"Found array with 0 feature\(s\) \(shape=\(10, 0\)\)"),
        (lambda: np.array([["a", "b"]] * 10), "fit: X row 0, column 0 is 'a', not a number"),
        (lambda: pd.DataFrame({"a": ["x"] * 20, "b": 1.0}), "fit: X row 0, column 'a' is 'x', not a number"),
        (lambda: [[1.0, 2.0]] * 5 + [[1.0, "abc"]], "fit: X row 5, column 1 is 'abc', not a number"),
        (lambda: pd.DataFrame({"a": 1.0, "b_err": ["1"] * 5 + ["x"]}), "X row 5, column 'b_err' is 'x', not a number"),
        (
            lambda: pd.DataFrame({"a": pd.array([1, None] * 10, dtype="Int64"), "b": 1.0}),
            "X row 1, column 0 contains NaN or inf",
        ),
        (
            lambda: np.array([[1 + 1j, 0]] * 10),
            r"fit: Complex data not supported: X is complex \(complex128\); XD fits real features",
        ),
    ],
)
def test_unusable_arrays_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        XDGMM(2, device="cpu").fit(make())


def test_dataframes_and_integers_are_read_as_numbers():
    frame = pd.DataFrame(X, columns=["a", "b"])
    a = XDGMM(2, epochs=2, device="cpu", random_state=0).fit(frame)
    b = XDGMM(2, epochs=2, device="cpu", random_state=0).fit(X)
    np.testing.assert_array_equal(a.means_, b.means_)
    assert XDGMM(1, epochs=1, device="cpu").fit(np.arange(40, dtype=np.uint32).reshape(20, 2)).n_iter_ == 1


def test_half_precision_is_converted_and_said_so():
    """float16 keeps 2-3 digits: the values are fitted as given (the same fit as their exact float64
    copies), with a warning that says what the user loses."""
    half = X.astype(np.float16)
    with pytest.warns(UserWarning, match="X is float16, which keeps only 2-3 significant digits"):
        from_half = XDGMM(2, epochs=2, device="cpu", random_state=0).fit(half)
    exact = XDGMM(2, epochs=2, device="cpu", random_state=0).fit(half.astype(np.float64))
    np.testing.assert_allclose(from_half.means_, exact.means_, rtol=1e-5)  # float32 pass either way


def test_one_shared_covariance_is_refused_with_the_broadcast_that_gives_one_per_point():
    shared = np.array([[0.1, 0.02], [0.02, 0.2]])
    with pytest.raises(
        ValueError, match=r"Xcov has shape \(2, 2\): one noise covariance.*np.broadcast_to\(C, \(200, 2, 2\)\)"
    ):
        XDGMM(2, epochs=1, device="cpu").fit(X, Xcov=shared)
    per_point = XDGMM(2, epochs=1, device="cpu", random_state=0).fit(X, Xcov=np.broadcast_to(shared, (200, 2, 2)))
    copied = XDGMM(2, epochs=1, device="cpu", random_state=0).fit(X, Xcov=np.tile(shared, (200, 1, 1)))
    np.testing.assert_array_equal(per_point.means_, copied.means_)


def test_posterior_with_the_wrong_dimension_is_named(fitted):
    with pytest.raises(ValueError, match="X has 3 features, but XDGMM is expecting 2 features as input"):
        fitted.posterior(np.zeros((5, 3)))
    with pytest.raises(ValueError, match="the model has dimension 2 but the data"):  # R maps to 3 dimensions
        fitted.posterior(np.zeros((5, 3)), R=np.broadcast_to(np.eye(3), (5, 3, 3)))


def test_sample_counts(fitted):
    assert [a.shape for a in fitted.sample(0)] == [(0, 2), (0,)]
    assert [a.shape for a in fitted.sample(np.int64(3), random_state=1)] == [(3, 2), (3,)]
    for bad in (-5, 2.7, "3", True):
        with pytest.raises(ValueError, match=f"n_samples must be a non-negative integer, got {bad!r}"):
            fitted.sample(bad)


@pytest.mark.parametrize(
    "name, value",
    [
        ("random_state", "abc"),
        ("random_state", 2**70),
        ("random_state", -1),
        ("random_state", 1.5),
        ("verbose", "x"),
        ("verbose", 3),
        ("verbose", -1),
    ],
)
def test_settings_of_the_wrong_kind_are_named(name, value):
    with pytest.raises(ValueError, match=f"{name} must be .*, got {value!r}"):
        XDGMM(2, **{name: value}).fit(X)


def test_sample_seed_is_checked(fitted):
    with pytest.raises(ValueError, match="random_state must be None, an integer in"):
        fitted.sample(3, random_state="abc")


def test_weights_whose_sum_overflows_are_refused_naming_the_sum():
    with pytest.raises(ValueError, match="sample_weight sums to inf, beyond float64's range: rescale the weights"):
        XDGMM(2, epochs=1, device="cpu").fit(X, sample_weight=np.full(len(X), 1e308))


@pytest.mark.slow
@pytest.mark.parametrize("method, fitter", [("minibatch_em", MinibatchEM), ("sgd", SGD)])
def test_a_minibatch_of_zero_total_weight_makes_no_update(method, fitter, monkeypatch):
    """10 weighted stars among 200, in batches of 20: most batches weigh nothing; they used to divide by
    zero. Exactly the batches holding a weighted star are observed, and the fit stays finite."""
    weights = np.zeros(len(X))
    weights[RNG.choice(len(X), 10, replace=False)] = 1.0
    observed = []
    real = fitter.observe
    monkeypatch.setattr(fitter, "observe", lambda self, stats: (observed.append(stats.n_points), real(self, stats)))
    model = XDGMM(2, method, n_init=1, epochs=3, batch_size=20, device="cpu", dtype="float64", random_state=0)
    model.fit(X, sample_weight=weights)
    batches = [rows for epoch in (1, 2, 3) for rows in epoch_order(len(X), 20, epoch, 0, True)]  # seed 0
    weighted = [(weights[rows] > 0).any() for rows in batches]
    assert len(observed) == sum(weighted) < 30 and all(n > 0 for n in observed)
    assert np.isfinite(model.means_).all() and np.isfinite(model.history_[-1]["train_loglik"])


@pytest.mark.slow
def test_unclear_inputs_are_named_by_the_argument_they_came_in():
    """Each case below gave numpy's or pyarrow's words (an inhomogeneous shape, ArrowInvalid, "need at least
    one array to stack", "could not convert string to float") or named warm_start, which was not set."""
    import tempfile
    from pathlib import Path

    from scalable_xd.data.stream import ParquetSource

    V = np.full(X.shape, 0.1)
    with pytest.raises(ValueError, match=r"X batch 0: it is a tuple of 4 items, where a batch is a tuple \(X, Xcov\)"):
        XDGMM(2).fit([(X, V, np.ones(len(X)), 1)])
    with pytest.raises(ValueError, match=r"X batch 0: X must have shape \(N, d\), got \(200,\)"):
        XDGMM(2).fit([(X[:, 0], V[:, 0])])

    class Rows:  # map-style, without torch
        def __getitem__(self, i):
            return X[i], V[i]

        def __len__(self):
            return len(X)

    with pytest.raises(ValueError, match=r"X is a Rows \(__getitem__ and __len__\), which gives one point at a time"):
        XDGMM(2).fit(Rows())
    folder = Path(tempfile.mkdtemp())
    (folder / "empty.parquet").write_bytes(b"")
    (folder / "table.csv").write_text("a,b\n1,2\n")
    for name in ("empty.parquet", "table.csv"):
        with pytest.raises(ValueError, match=f"{folder / name} is not a readable Parquet data set"):
            ParquetSource(folder / name, ["a", "b"])
    with pytest.raises(ValueError, match="x_columns is empty"):
        ParquetSource(folder / "table.csv", [])
    streamed = Path(tempfile.mkdtemp())  # a folder of Parquet files, one of them damaged: that one named
    pd.DataFrame({"a": X[:, 0], "b": X[:, 1]}).to_parquet(streamed / "good.parquet")
    whole = (streamed / "good.parquet").read_bytes()
    for damaged in (b"", b"a,b\n1,2\n", whole[: len(whole) // 2]):
        (streamed / "part.parquet").write_bytes(damaged)
        with pytest.raises(ValueError, match=f"X: {streamed / 'part.parquet'} is not a readable Parquet file"):
            ParquetSource(streamed, ["a", "b"])
    model = XDGMM(2, "minibatch_em", epochs=2, random_state=0).fit(X, Xcov=V)
    with pytest.raises(ValueError, match=r"q must hold numbers, got \['a'\]"):
        model.posterior(X, Xcov=V, q=["a"])
    with pytest.raises(ValueError, match=r"X_given must hold numbers, got \['a', None\]"):
        model.condition(["a", None])
    with pytest.raises(ValueError, match="X has 3 features, but XDGMM is expecting 2 features as input"):
        model.partial_fit(np.zeros((50, 3)), Xcov=np.full((50, 3), 0.1))

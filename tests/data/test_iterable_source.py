"""Fits from an iterable of batches (``iterable.IterableSource``) and from a user's own ``DataSource``:
the same model as the arrays in the same order, bad batches named, checkpoints resumed where they can be."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import scalable_xd.fit.run.checkpoint
from scalable_xd import XDGMM
from scalable_xd.data.batching import epoch_order
from scalable_xd.data.dataset import Dataset
from scalable_xd.data.source import DataSource
from scalable_xd.data.stream import ParquetSource

BATCH = 200
SEED = 3


def _data(n=2000, seed=0):
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(size=(n // 2, 2)), rng.normal(size=(n // 2, 2)) + 4])
    variances = rng.uniform(0.05, 0.3, size=(n, 2))
    return x + rng.normal(size=x.shape) * np.sqrt(variances), np.stack([np.diag(v) for v in variances])


class EpochOrder:
    """A batch sampler that gives the rows of each epoch in the order ``XDGMM.fit`` draws for arrays: what a
    user's sampler with ``set_epoch`` (as PyTorch's ``DistributedSampler``) looks like to the fit."""

    def __init__(self, n, batch_size, seed):
        self.n, self.batch_size, self.seed, self.epoch = n, batch_size, seed, 0
        self.epochs_set = []

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.epochs_set.append(epoch)

    def __iter__(self):
        for index in epoch_order(self.n, self.batch_size, self.epoch, self.seed, True):
            yield index.tolist()

    def __len__(self):
        return len(epoch_order(self.n, self.batch_size, self.epoch, self.seed, True))


def _settings(method, **extra):
    x, _ = _data()
    init = dict(means_init=x[[0, 1500]], weights_init=[0.5, 0.5], covariances_init=np.tile(np.eye(2), (2, 1, 1)))
    settings = dict(
        n_components=2, method=method, epochs=3, batch_size=BATCH, tol=None, dtype="float64", device="cpu", **init
    )
    return {**settings, "random_state": SEED, **extra}


def _assert_same_fit(a, b, rtol=1e-10):
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(a, attr), getattr(b, attr), rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(
        [h["train_loglik"] for h in a.history_], [h["train_loglik"] for h in b.history_], rtol=rtol
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", ["minibatch_em", "sgd", "stochastic_minibatch_em"])
def test_a_dataloader_in_the_fits_order_gives_the_fit_of_the_arrays(method):
    x, S = _data()
    sampler = EpochOrder(len(x), BATCH, SEED)
    loader = DataLoader(TensorDataset(torch.tensor(x), torch.tensor(S)), batch_sampler=sampler)
    from_arrays = XDGMM(**_settings(method)).fit(x, Xcov=S)
    from_loader = XDGMM(**_settings(method)).fit(loader)
    _assert_same_fit(from_arrays, from_loader)
    assert sampler.epochs_set == [1, 2, 3]  # told each epoch before it was read


def test_batch_em_over_an_unshuffled_dataloader_equals_the_arrays_k_means_included():
    """Batch EM sums every batch, whatever their sizes; k-means sees every point, in the arrays' order."""
    x, S = _data()
    settings = dict(n_components=3, method="em", epochs=6, tol=None, dtype="float64", device="cpu", random_state=1)
    from_arrays = XDGMM(**settings).fit(x, Xcov=S)
    loader = DataLoader(TensorDataset(torch.tensor(x), torch.tensor(S)), batch_size=333)
    from_loader = XDGMM(**settings).fit(loader)
    _assert_same_fit(from_arrays, from_loader)
    np.testing.assert_allclose(from_loader.score(loader), from_arrays.score(x, Xcov=S), rtol=1e-12)


def test_weighted_batches_in_a_list_count_as_sample_weight_does():
    """(X, Xcov, weights) tuples; batches with diagonal variances (N, d), as arrays may be given."""
    x, S = _data()
    weights = np.random.default_rng(5).uniform(0, 3, size=len(x))
    variances = np.diagonal(S, axis1=1, axis2=2)
    settings = dict(n_components=2, method="em", epochs=5, tol=None, dtype="float64", device="cpu", random_state=1)
    from_arrays = XDGMM(**settings).fit(x, Xcov=S, sample_weight=weights)
    batches = [(x[i : i + 500], variances[i : i + 500], weights[i : i + 500]) for i in range(0, len(x), 500)]
    from_list = XDGMM(**settings).fit(batches)
    _assert_same_fit(from_arrays, from_list)


def test_a_checkpoint_inside_an_epoch_resumes_where_the_iterable_says_its_epoch(tmp_path, monkeypatch):
    x, S = _data()
    settings = _settings("minibatch_em")

    def loader():
        return DataLoader(
            TensorDataset(torch.tensor(x), torch.tensor(S)), batch_sampler=EpochOrder(len(x), BATCH, SEED)
        )

    uninterrupted = XDGMM(**settings).fit(loader())
    checkpoint, save = tmp_path / "fit.ckpt", scalable_xd.fit.run.checkpoint.save

    def save_then_crash(path, **state):
        save(path, **state)
        if state["epoch"] == 1 and state["batch"] == 4:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(scalable_xd.fit.run.checkpoint, "save", save_then_crash)
        with pytest.raises(KeyboardInterrupt):
            XDGMM(**settings).fit(loader(), checkpoint=checkpoint, checkpoint_every=4)
    resumed = XDGMM(**settings).fit(loader(), checkpoint=checkpoint, checkpoint_every=4)
    _assert_same_fit(uninterrupted, resumed, rtol=1e-13)


def test_an_iterable_without_set_epoch_checkpoints_at_epochs_ends_only(tmp_path, monkeypatch):
    x, S = _data()
    settings = _settings("minibatch_em")
    batches = [(x[i : i + BATCH], S[i : i + BATCH]) for i in range(0, len(x), BATCH)]
    with pytest.raises(ValueError, match=r"checkpoint_every: X is an iterable of batches without set_epoch"):
        XDGMM(**settings).fit(batches, checkpoint=tmp_path / "a.ckpt", checkpoint_every=3)
    straight = XDGMM(**settings).fit(batches)
    checkpoint, save = tmp_path / "b.ckpt", scalable_xd.fit.run.checkpoint.save

    def save_then_crash(path, **state):
        save(path, **state)
        if state["epoch"] == 2:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(scalable_xd.fit.run.checkpoint, "save", save_then_crash)
        with pytest.raises(KeyboardInterrupt):
            XDGMM(**settings).fit(batches, checkpoint=checkpoint)
    resumed = XDGMM(**settings).fit(batches, checkpoint=checkpoint)  # epoch 3 only
    _assert_same_fit(straight, resumed, rtol=1e-13)
    again = XDGMM(**settings).fit(batches[::-1], checkpoint=checkpoint)  # the same points in another order
    _assert_same_fit(straight, again, rtol=1e-13)
    with pytest.raises(ValueError, match="written by a different fit .other data"):
        XDGMM(**settings).fit(batches[1:], checkpoint=checkpoint)


def test_bad_batches_are_named_by_batch_and_row():
    x, S = _data(400)
    batches = [(x[i : i + 100].copy(), S[i : i + 100].copy()) for i in range(0, 400, 100)]
    batches[2][0][17, 1] = np.nan
    with pytest.raises(ValueError, match=r"^X batch 2: X row 17, column 1 contains NaN or inf"):
        XDGMM(n_components=2).fit(batches)
    batches[2][0][17, 1] = 0.0
    batches[3][1][5] = -np.eye(2)
    with pytest.raises(ValueError, match=r"^X batch 3: .*row 5"):
        XDGMM(n_components=2).fit(batches)
    with pytest.raises(ValueError, match=r"X batch 1: it has 3 features, the first batch 2"):
        XDGMM(n_components=2).fit([batches[0], (np.zeros((10, 3)), np.zeros((10, 3, 3)))])
    with pytest.raises(ValueError, match=r"X batch 0: it is a dict, where a batch is a tuple \(X, Xcov\)"):
        XDGMM(n_components=2).fit(DataLoader([{"x": torch.zeros(2)}] * 4, batch_size=2))
    with pytest.raises(ValueError, match=r"X batch 0: X row 0, column 0 has a value beyond"):
        XDGMM(n_components=2).fit([(np.full((10, 2), 1e30), np.zeros((10, 2)))])  # float32's range
    with pytest.raises(ValueError, match=r"X is a torch Dataset, which gives one point at a time: give a DataLoader"):
        XDGMM(n_components=2).fit(TensorDataset(torch.tensor(x), torch.tensor(S)))
    with pytest.raises(TypeError, match="X is an iterator, which can be read once"):
        XDGMM(n_components=2).fit(iter(batches))
    with pytest.raises(ValueError, match=r"X is an iterable of batches, which carries its own noise .*: Xcov"):
        XDGMM(n_components=2).fit(batches, Xcov=S)
    batches[3][1][5] = np.eye(2)
    with pytest.raises(ValueError, match="partial_fit takes one batch of arrays per call, and X is a IterableSource"):
        XDGMM(n_components=2, method="minibatch_em").partial_fit(batches)


class Spoiling:
    """An iterable whose third pass (the first epoch's) gives a NaN: checked there too."""

    def __init__(self, batches):
        self.batches, self.passes = batches, 0

    def __iter__(self):
        self.passes += 1
        for number, (x, S) in enumerate(self.batches):
            yield (np.where(number == 1 and self.passes >= 4, np.nan, x), S)


def test_a_bad_value_that_appears_in_a_later_pass_is_named():
    x, S = _data(400)
    batches = [(x[i : i + 100], S[i : i + 100]) for i in range(0, 400, 100)]
    settings = _settings("minibatch_em", epochs=2)
    with pytest.raises(ValueError, match=r"^X batch 1: X row 0, column 0 contains NaN or inf"):
        XDGMM(**settings).fit(Spoiling(batches))


class Shrinking:
    """An iterable whose passes lose a batch each time: not the same data every epoch."""

    def __init__(self, batches):
        self.batches, self.passes = batches, 0

    def __iter__(self):
        self.passes += 1
        return iter(self.batches[: max(len(self.batches) - self.passes + 1, 1)])


def test_an_iterable_that_changes_between_passes_is_refused():
    x, S = _data(400)
    batches = [(x[i : i + 100], S[i : i + 100]) for i in range(0, 400, 100)]
    with pytest.raises(
        ValueError, match=r"X gave 300 points in the pass that checked its range but 400 when it was opened"
    ):
        XDGMM(n_components=2, method="minibatch_em", device="cpu").fit(Shrinking(batches))


class Rescaled:
    """A user's own source: arrays in memory, in a unit of their choosing, read through the protocol."""

    def __init__(self, x, S, scale):
        self.inner, self.missing = Dataset(x * scale, S * scale**2), "variance"

    def __len__(self):
        return len(self.inner)

    obs_dim = property(lambda self: self.inner.obs_dim)
    model_dim = property(lambda self: self.inner.model_dim)
    total_weight = property(lambda self: self.inner.total_weight)

    def check_range(self, dtype, name="X"):
        self.inner.check_range(dtype, name)

    def epoch_batches(self, *args, **kwargs):
        return self.inner.epoch_batches(*args, **kwargs)

    def scan(self, *args):
        return self.inner.scan(*args)

    def sample(self, rows, name):
        return self.inner.sample(rows, name)

    def digest_bytes(self, rows):
        return self.inner.digest_bytes(rows)


def test_a_users_own_source_fits_through_the_protocol(tmp_path):
    x, S = _data()
    source = Rescaled(x, S, 2.0)
    assert isinstance(source, DataSource) and isinstance(Dataset(x, S), DataSource)
    assert not isinstance(x, DataSource)
    settings = _settings("minibatch_em")
    settings["means_init"] = settings["means_init"] * 2.0
    from_source = XDGMM(**settings).fit(source, checkpoint=tmp_path / "own.ckpt")
    from_arrays = XDGMM(**settings).fit(x * 2.0, Xcov=S * 4.0)
    _assert_same_fit(from_arrays, from_source)
    with pytest.raises(ValueError, match=r"X is a Rescaled, which carries its own noise .*: R, sample_weight"):
        XDGMM(n_components=2).fit(source, R=np.zeros((len(x), 2, 2)), sample_weight=np.ones(len(x)))


def test_a_parquet_source_is_a_data_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"a": [0.0, 1.0], "b": [1.0, 2.0]}), tmp_path / "t.parquet")
    assert isinstance(ParquetSource(tmp_path / "t.parquet", ["a", "b"]), DataSource)


def test_a_data_parallel_fit_refuses_an_iterable(monkeypatch):
    """Processes cannot split an iterable's batches the same way: refused before any work."""
    from scalable_xd.fit import driver
    from scalable_xd.fit.run import parallel
    from scalable_xd.fit.run.parallel import Group

    x, S = _data(400)
    monkeypatch.setattr(driver.Group, "current", classmethod(lambda cls: Group(0, 2)))
    # two processes given the same input: every exchange before the refusal hears this one's answer twice
    monkeypatch.setattr(parallel.dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), [mine] * 2))
    with pytest.raises(ValueError, match="X is an iterable of batches, which fits in one process"):
        XDGMM(n_components=2, n_init=1, device="cpu").fit([(x, S)])

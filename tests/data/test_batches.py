"""The in-memory data set's batches: read in place where the CPU's pass can, gathered otherwise, the same rows."""

import numpy as np
import pytest
import torch

from scalable_xd.data.batching import epoch_order
from scalable_xd.data.dataset import Dataset
from scalable_xd.data.noise import CompactCovariance
from scalable_xd.fit.run.parallel import ONE_PROCESS

CPU = torch.device("cpu")


def _data(rng, n=1300, d=3):
    X = rng.normal(size=(n, d))
    a = rng.normal(size=(n, d, d)) * 0.3
    return X, a @ a.transpose(0, 2, 1) + 0.1 * np.eye(d)


@pytest.mark.parametrize("form", ["dense", "diagonal", "compact"])
def test_batches_of_plain_rows_name_them_in_place_and_gather_them_when_read(form):
    """Shuffled batches of plain rows on the CPU say where their rows lie (``in_memory``: the epoch's row
    numbers, the arrays themselves, not copies), and hold the rows gathered and converted, as the batches of
    a data set that cannot be read in place (weighted by ones) hold them."""
    rng = np.random.default_rng(0)
    X, S = _data(rng)
    sigma = np.sqrt(np.diagonal(S, axis1=1, axis2=2))
    noise = {
        "dense": S,
        "diagonal": np.ascontiguousarray(sigma**2),
        "compact": CompactCovariance(sigma, rng.uniform(-0.5, 0.5, size=(len(X), 2)), [(1, 0), (2, 0)]),
    }[form]
    data = Dataset(X, noise)
    weighted = Dataset(X, noise, sample_weight=np.ones(len(X)))
    order = epoch_order(len(X), 200, 2, 7, True)
    batches = list(data.epoch_batches(200, 2, 7, True, ONE_PROCESS, CPU, torch.float32, in_place=True))
    gathered = list(weighted.epoch_batches(200, 2, 7, True, ONE_PROCESS, CPU, torch.float32, in_place=True))
    assert len(batches) == len(gathered) == len(order) == 6
    as_numpy = epoch_order(len(X), 200, 2, 7, True, as_numpy=True)  # the same rows, as numpy arrays
    assert all(isinstance(a, np.ndarray) and np.array_equal(a, t.numpy()) for a, t in zip(as_numpy, order, strict=True))
    for rows, batch, other in zip(order, batches, gathered, strict=True):
        assert other.in_memory is None and batch.in_memory is not None
        assert np.array_equal(batch.in_memory.rows, rows.numpy())
        held = batch.in_memory.noise[0] if form == "compact" else batch.in_memory.noise
        assert np.shares_memory(batch.in_memory.X, X) and np.shares_memory(held, sigma if form == "compact" else noise)
        assert batch.size == len(rows) and batch.R is None and batch.weights is None and batch.observed is None
        assert batch.x.dtype == torch.float32 and torch.equal(batch.x, other.x) and torch.equal(batch.S, other.S)
        if form == "dense":
            assert torch.equal(batch.S, torch.tensor(S[rows.numpy()], dtype=torch.float32))


def test_batches_that_cannot_be_read_in_place_are_gathered():
    """Projections, no noise or rows not C-contiguous, or a pass that does not read rows in place
    (``in_place`` False: the GPU's, the torch kernels', stochastic EM's): gathered."""
    rng = np.random.default_rng(1)
    X, S = _data(rng, n=400)
    cases = [
        Dataset(X, S, R=np.broadcast_to(np.eye(3), (400, 3, 3)).copy()),
        Dataset(np.asfortranarray(X), S),
        Dataset(X),  # no noise: nothing to read in place
    ]
    for data in cases:
        batch = next(iter(data.epoch_batches(100, 1, 0, True, ONE_PROCESS, CPU, torch.float64, in_place=True)))
        assert batch.in_memory is None and batch.x.shape == (100, 3)
    batch = next(iter(Dataset(X, S).epoch_batches(100, 1, 0, True, ONE_PROCESS, CPU, torch.float64)))
    assert batch.in_memory is None and torch.equal(batch.x, torch.tensor(X[batch_rows(400, 100, 1, 0)]))


def test_batches_with_missing_entries_are_read_in_place_with_their_mask():
    """Missing entries marginalised: each batch names its rows and the data set's observed entries, and
    gathers, when read, the x (0 where missing), S and mask of the batches made without reading in place."""
    rng = np.random.default_rng(1)
    X, S = _data(rng, n=400)
    X[rng.random(X.shape) < 0.2] = np.nan
    data = Dataset(X, S, missing="marginalise")
    in_place = data.epoch_batches(100, 1, 0, True, ONE_PROCESS, CPU, torch.float64, in_place=True)
    gathered = data.epoch_batches(100, 1, 0, True, ONE_PROCESS, CPU, torch.float64)
    for batch, other in zip(in_place, gathered, strict=True):
        place = batch.in_memory
        assert place is not None and other.in_memory is None
        assert np.shares_memory(place.X, data.X.numpy()) and np.array_equal(place.observed, ~np.isnan(X))
        assert torch.equal(batch.observed, other.observed) and not batch.observed.all()
        assert torch.equal(batch.x, other.x) and torch.equal(batch.S, other.S) and not batch.x.isnan().any()


def batch_rows(n, batch_size, epoch, seed):
    """The first batch's row numbers of a shuffled epoch (``batching.epoch_order``)."""
    return epoch_order(n, batch_size, epoch, seed, True)[0].numpy()


@pytest.mark.parametrize("form", ["dense", "diagonal", "compact", "none"])
def test_data_held_resident_give_the_same_batches_value_for_value(form):
    """The data a fit scores after every epoch are held on its device in its dtype (``Dataset.resident``):
    their scans give the host's batches to the bit, the weights (a float64 total) left where they were."""
    rng = np.random.default_rng(91)
    X, S = _data(rng)
    sigma = np.sqrt(np.diagonal(S, axis1=1, axis2=2))
    corr = np.stack([S[:, i, j] / (sigma[:, i] * sigma[:, j]) for i, j in [(0, 1), (0, 2), (1, 2)]], 1)
    noise = {
        "dense": S,
        "diagonal": np.diagonal(S, axis1=1, axis2=2).copy(),
        "compact": CompactCovariance(sigma, corr, [(0, 1), (0, 2), (1, 2)]),
        "none": None,
    }[form]
    host = Dataset(X, noise, sample_weight=rng.uniform(0.5, 2.0, len(X)))
    held = host.resident(CPU, torch.float32)
    assert held is not host and held.X.dtype == torch.float32
    assert held.weights.data_ptr() == host.weights.data_ptr()
    for ours, theirs in zip(
        held.scan(slice(0, len(X)), 500, CPU, torch.float32), host.scan(slice(0, len(X)), 500, CPU, torch.float32)
    ):
        first, *tensors = ours
        assert first == theirs[0]
        for a, b in zip(tensors, theirs[1:]):
            assert (a is None and b is None) or torch.equal(a, b)


def test_data_that_a_scan_must_convert_stay_on_the_host(monkeypatch):
    """Projections, missing entries and noise mixtures are read as before, and so are data beyond the budget."""
    from scalable_xd.data import dataset

    rng = np.random.default_rng(92)
    X, S = _data(rng, n=200)
    projected = Dataset(X, S, R=np.repeat(np.eye(3)[None], 200, axis=0))
    X[3, 1] = np.nan
    missing = Dataset(X, S, missing="marginalise")
    assert projected.resident(CPU, torch.float32) is projected
    assert missing.resident(CPU, torch.float32) is missing
    plain = Dataset(X[~np.isnan(X).any(1)], S[~np.isnan(X).any(1)])
    monkeypatch.setattr(dataset, "RESIDENT_BYTES", len(plain) * (3 + 9) * 4)  # x and S in float32, exactly
    assert plain.resident(CPU, torch.float32) is not plain
    monkeypatch.setattr(dataset, "RESIDENT_BYTES", len(plain) * (3 + 9) * 4 - 1)
    assert plain.resident(CPU, torch.float32) is plain

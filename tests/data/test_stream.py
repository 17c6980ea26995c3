"""Streamed data (``stream.ParquetSource``): the batches it serves are the rows it names, every epoch is a
partition of the data set, and a fit streamed from eight shards equals the fit of the same rows held in
memory on the same global batches; a resumed streamed fit equals an uninterrupted one."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import scalable_xd.data.dataset
import scalable_xd.fit.driver
import scalable_xd.fit.run.checkpoint
from scalable_xd import XDGMM, CompactCovariance
from scalable_xd.data.batching import Batch, batch_bounds
from scalable_xd.data.stream import ParquetSource
from scalable_xd.fit.run.checkpoint import CheckpointError

PAIRS = [(0, 1), (1, 2)]
SHARDS = 8


def _problem(n=1800, seed=11):
    """Three noisy clusters in 3-D with per-row standard deviations and two correlations."""
    rng = np.random.default_rng(seed)
    means = np.array([[0.0, 0.0, 0.0], [4.0, 0.0, 1.0], [0.0, 5.0, -2.0]])
    x = rng.normal(size=(n, 3)) + means[rng.integers(0, 3, n)]
    sigma = rng.uniform(0.1, 0.6, size=(n, 3))
    corr = rng.uniform(-0.5, 0.5, size=(n, 2))
    return x, sigma, corr


def _write_shards(folder, x, sigma, corr, shards=SHARDS, row_group=90):
    """The rows in ``shards`` files of unequal length, each in row groups of ``row_group`` rows."""
    folder.mkdir(parents=True, exist_ok=True)
    cuts = np.linspace(0, len(x), shards + 1).astype(int)
    cuts[1:-1] += np.arange(1, shards) * 7 % 23  # unequal shards
    for number, (start, stop) in enumerate(zip(cuts[:-1], cuts[1:])):
        columns = {f"x{k}": x[start:stop, k] for k in range(3)}
        columns |= {f"s{k}": sigma[start:stop, k] for k in range(3)}
        columns |= {f"c{p}": corr[start:stop, p] for p in range(2)}
        pq.write_table(pa.table(columns), folder / f"part-{number}.parquet", row_group_size=row_group)
    return folder


def _source(folder, window_rows=400, **kwargs):
    return ParquetSource(
        folder, ["x0", "x1", "x2"], ["s0", "s1", "s2"], ["c0", "c1"], PAIRS, window_rows=window_rows, **kwargs
    )


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    x, sigma, corr = _problem()
    return _write_shards(tmp_path_factory.mktemp("shards"), x, sigma, corr), (x, sigma, corr)


def test_each_epoch_is_a_partition_in_the_in_memory_batch_sizes(shards):
    folder, (x, _, _) = shards
    source = _source(folder)
    assert len(source) == len(x) and len(source.layout) > SHARDS  # several row groups per shard
    orders = []
    for epoch in (1, 2):
        batches = list(source.epoch_rows(130, epoch, seed=4))
        assert [len(b) for b in batches] == [stop - start for start, stop in batch_bounds(len(x), 130)]
        rows = np.concatenate(batches)
        assert np.array_equal(np.sort(rows), np.arange(len(x)))
        orders.append(rows)
    assert not np.array_equal(orders[0], orders[1])
    assert np.array_equal(np.concatenate(list(source.epoch_rows(130, 2, seed=4))), orders[1])  # reproducible
    assert np.array_equal(np.concatenate(list(source.epoch_rows(130, 1, seed=4, shuffle=False))), np.arange(len(x)))
    for shuffle in (False, True):  # batches larger than the window (batch EM's chunks) take several windows
        large = list(source.epoch_rows(700, 1, seed=4, shuffle=shuffle))
        assert [len(b) for b in large] == [700, 1100]
        assert np.array_equal(np.sort(np.concatenate(large)), np.arange(len(x)))
    # a batch mixes row groups from several shards, not one group's rows in file order
    first = next(iter(source.epoch_rows(130, 1, seed=4)))
    assert len(np.unique(np.searchsorted(np.cumsum([r for _, _, r in source.layout]), first, side="right"))) > 3


def test_served_batches_hold_the_rows_they_name(shards):
    folder, (x, sigma, corr) = shards
    source = _source(folder)
    S_all = CompactCovariance(sigma, corr, PAIRS).dense().numpy()
    from scalable_xd.fit.run.parallel import ONE_PROCESS

    served = source.epoch_batches(130, 3, 4, True, ONE_PROCESS, "cpu", torch.float64)
    for rows, batch in zip(source.epoch_rows(130, 3, seed=4), served, strict=True):
        np.testing.assert_array_equal(batch.x.numpy(), x[rows])
        np.testing.assert_allclose(batch.S.numpy(), S_all[rows], rtol=1e-15)
        assert batch.size == len(rows) and batch.R is None and batch.weights is None


def test_served_batches_are_read_in_place_from_one_reused_window_and_expire_when_it_is_refilled(shards):
    """On the CPU a batch names its rows in the window (``in_memory``), and the statistics pass reads them
    there as it reads them gathered (to rounding: the kernel fuses S's products into its sums); every window
    of the epoch is filled in the same memory, and the last batch of each is gathered, so that the batch a
    fit's loop still holds is never one whose rows are being replaced; a batch held past its window's refill
    can no longer be read (an error, not other rows)."""
    from scalable_xd.fit.run.parallel import ONE_PROCESS
    from scalable_xd.kernel.fused import PlainPass
    from scalable_xd.mixture import Mixture

    folder, _ = shards
    source = _source(folder)
    mixture = Mixture(
        torch.full((3,), 1 / 3.0), torch.tensor([[0.0, 0, 0], [4, 0, 1], [0, 5, -2]]), torch.eye(3).expand(3, 3, 3)
    )
    plain = PlainPass(3, 3, torch.float32, 1 << 20)
    rows = list(source.epoch_rows(130, 2, seed=4))
    memory, in_place, held = set(), 0, []  # held: as a caller that keeps its batches
    batches = source.epoch_batches(130, 2, 4, True, ONE_PROCESS, "cpu", torch.float32, in_place=True)
    for batch, named in zip(batches, rows, strict=True):
        held.append(batch)
        if batch.in_memory is None:
            continue
        in_place += 1
        memory.add(batch.in_memory.X.base.ctypes.data)
        assert np.array_equal(
            batch.in_memory.X[batch.in_memory.rows],
            source.sample(torch.as_tensor(np.sort(named)), "x").X.numpy()[np.argsort(np.argsort(named))],
        )
        read, gathered = (
            plain.statistics(batch, mixture),
            plain.statistics(Batch(batch.size, batch.x, batch.S, None, None), mixture),
        )
        for name in ("q", "U", "UU", "P", "loglik"):
            assert torch.allclose(getattr(read, name), getattr(gathered, name), rtol=1e-5, atol=0), name
    assert in_place > len(rows) // 2 and len(memory) == 1, "every window in one allocation"
    assert held[0].in_memory is None, "expired when its window was refilled"
    batches = source.epoch_batches(130, 2, 4, True, ONE_PROCESS, "cpu", torch.float32, in_place=True)
    unread = next(batches)
    assert unread.in_memory is not None
    for _ in batches:
        pass
    with pytest.raises(RuntimeError, match="shuffle window has since been refilled"):
        _ = unread.x


def test_the_next_epoch_fills_its_windows_in_the_memory_of_the_last_and_serves_the_same_rows(shards):
    """Memory never touched costs its first touch (0.3-0.5 s a 1,048,576-row window on a virtual machine whose
    host takes freed memory back), so a source keeps its last window's memory for its next epoch: the same
    allocation, the same rows as a fresh source serves; a batch of the finished epoch read in place can no
    longer be read; a pickled copy of the source keeps no memory."""
    import pickle

    from scalable_xd.fit.run.parallel import ONE_PROCESS

    folder, _ = shards
    source = _source(folder)

    def epoch(data, number, read=True):
        """(the batches named in the window, each batch's rows as read while it was served (where ``read``),
        the windows' memory: held, so that no later allocation can take its place)."""
        in_place, rows, memory = [], [], []
        for batch in data.epoch_batches(130, number, 4, True, ONE_PROCESS, "cpu", torch.float32, in_place=True):
            if batch.in_memory is not None:
                in_place.append(batch)
                memory.append(batch.in_memory.X.base)
            if read:
                rows.append(batch.x.numpy().copy())
        return in_place, rows, memory

    first, _, memory_first = epoch(source, 1, read=False)
    _, rows_second, memory_second = epoch(source, 2)
    _, rows_fresh, _ = epoch(_source(folder), 2)
    assert all(np.shares_memory(memory_first[0], window) for window in memory_first + memory_second)
    assert len(rows_second) == len(rows_fresh)
    for kept, fresh in zip(rows_second, rows_fresh):
        assert np.array_equal(kept, fresh)
    with pytest.raises(RuntimeError, match="its epoch is over"):
        _ = first[-1].x
    assert source._kept and not pickle.loads(pickle.dumps(source))._kept


@pytest.mark.slow
@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd", "stochastic_minibatch_em"])
def test_a_streamed_fit_equals_the_in_memory_fit_on_the_same_batches(shards, method, monkeypatch):
    folder, (x, sigma, corr) = shards
    source = _source(folder)
    settings = dict(
        n_components=3, method=method, epochs=4, batch_size=100, tol=None, dtype="float64", device="cpu", random_state=2
    )
    streamed = XDGMM(**settings).fit(source, X_val=_source(folder))

    def the_streams_batches(n, batch_size, epoch, seed, shuffle, as_numpy=False):
        return [
            rows if as_numpy else torch.as_tensor(rows) for rows in source.epoch_rows(batch_size, epoch, seed, shuffle)
        ]

    monkeypatch.setattr(scalable_xd.data.dataset, "epoch_order", the_streams_batches)
    noise = CompactCovariance(sigma, corr, PAIRS)
    in_memory = XDGMM(**settings).fit(x, Xcov=noise, X_val=x, Xcov_val=noise)
    for name in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(streamed, name), getattr(in_memory, name), rtol=1e-10, atol=1e-12)
    for key in ("train_loglik", "val_loglik"):
        np.testing.assert_allclose(
            [h[key] for h in streamed.history_], [h[key] for h in in_memory.history_], rtol=1e-12
        )
    assert streamed.score(source) == pytest.approx(in_memory.score(x, Xcov=noise), rel=1e-12)


@pytest.mark.parametrize("every, crash_at", [(0, (2, 0)), (5, (2, 5))])  # at an epoch's end; inside epoch 3
def test_a_resumed_streamed_fit_equals_an_uninterrupted_one(shards, tmp_path, monkeypatch, every, crash_at):
    folder, _ = shards
    settings = dict(
        n_components=3,
        method="minibatch_em",
        epochs=5,
        batch_size=100,
        tol=None,
        dtype="float64",
        device="cpu",
        random_state=6,
    )
    uninterrupted = XDGMM(**settings).fit(_source(folder))
    checkpoint = tmp_path / "fit.ckpt"
    save = scalable_xd.fit.run.checkpoint.save

    def save_then_crash(path, **state):
        save(path, **state)
        if (state["epoch"], state["batch"]) == crash_at:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(scalable_xd.fit.run.checkpoint, "save", save_then_crash)
        with pytest.raises(KeyboardInterrupt):
            XDGMM(**settings).fit(_source(folder), checkpoint=checkpoint, checkpoint_every=every)
    resumed = XDGMM(**settings).fit(_source(folder), checkpoint=checkpoint, checkpoint_every=every)
    for name in ("weights_", "means_", "covariances_"):
        np.testing.assert_array_equal(getattr(resumed, name), getattr(uninterrupted, name))
    with pytest.raises(CheckpointError, match="other data"):  # another window: another order of batches
        XDGMM(**settings).fit(_source(folder, window_rows=500), checkpoint=checkpoint)


def test_k_means_sees_a_sample_and_the_fit_runs_from_a_hats_layout(tmp_path, monkeypatch):
    x, sigma, corr = _problem(n=600)
    root = tmp_path / "catalogue"
    _write_shards(root / "dataset" / "Norder=0" / "Dir=0", x, sigma, corr, shards=3)
    (root / "properties").write_text("dataproduct_type=object\n")
    (root / "dataset" / "_metadata").write_bytes(b"not read")  # HATS's summary files are skipped
    (root / "partition_info.csv").write_text("Norder,Npix\n0,1\n")
    monkeypatch.setattr(scalable_xd.fit.driver, "KMEANS_SAMPLE", 250)
    seen = []
    real = scalable_xd.fit.driver.initial_mixture
    monkeypatch.setattr(
        scalable_xd.fit.driver,
        "initial_mixture",
        lambda data, *a, **k: (seen.append(len(data)), real(data, *a, **k))[1],
    )
    model = XDGMM(n_components=3, method="em", n_init=1, epochs=3, dtype="float64", device="cpu", random_state=0)
    model.fit(_source(root))
    assert seen == [250]
    assert np.isfinite(model.history_[-1]["train_loglik"])


def test_bad_values_are_named_by_their_row_in_the_whole_data_set_and_their_file(tmp_path):
    x, sigma, corr = _problem(n=400)
    x[337, 1] = np.nan
    folder = _write_shards(tmp_path / "bad", x, sigma, corr, shards=4, row_group=50)
    with pytest.raises(
        ValueError,
        match=r"X row 337, column 1 contains NaN or inf; .*marginalise.* \(in .*part-3.parquet, row group \d\)",
    ):
        _source(folder)
    x[337, 1] = 0.0
    corr[12, 0] = 1.5
    folder = _write_shards(tmp_path / "bad_corr", x, sigma, corr, shards=4, row_group=50)
    with pytest.raises(
        ValueError, match=r"corr row 12, column 0 has a correlation outside \[-1, 1\] \(in .*part-0.parquet"
    ):
        _source(folder)
    with pytest.raises(ValueError, match="lacks the columns sigma_x"):
        ParquetSource(folder, ["x0"], ["sigma_x"])
    corr[12, 0] = 0.0
    good = _source(_write_shards(tmp_path / "good", x, sigma, corr, shards=4, row_group=50))
    with pytest.raises(
        ValueError, match=r"X is a ParquetSource, which carries its own noise \(and weights\): Xcov cannot be given"
    ):
        XDGMM(n_components=2).fit(good, Xcov=np.ones((400, 3)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no Parquet files"):
        _source(tmp_path / "empty")


def test_a_file_of_a_folder_without_a_column_or_with_text_is_named(tmp_path):
    """The folder's first file decides pyarrow's schema; a later one that lacks a sigma column, or holds
    text in one, is named with the column (pyarrow's 'No match for FieldRef' and numpy's dtype object did
    not)."""
    x, sigma, corr = _problem(n=400)
    folder = _write_shards(tmp_path / "gap", x, sigma, corr, shards=4, row_group=50)
    table = pq.read_table(folder / "part-2.parquet")
    pq.write_table(table.drop_columns(["s2"]), folder / "part-2.parquet")
    with pytest.raises(ValueError, match=r"part-2.parquet lacks the columns s2"):
        _source(folder)
    folder = _write_shards(tmp_path / "text", x, sigma, corr, shards=4, row_group=50)
    table = pq.read_table(folder / "part-1.parquet")
    text = pa.array([str(v) for v in table.column("x1").to_numpy()])
    pq.write_table(table.set_column(table.schema.get_field_index("x1"), "x1", text), folder / "part-1.parquet")
    with pytest.raises(ValueError, match=r"part-1.parquet: column x1 holds string, not numbers"):
        _source(folder)


def test_a_streamed_fit_marginalises_missing_entries_as_in_memory(tmp_path):
    """Entries with variance 1e12 (the features' convention) marginalised the same way from disk."""
    x, sigma, corr = _problem(n=900, seed=5)
    missing = np.random.default_rng(6).random(x.shape) < 0.2
    x[missing], sigma[missing] = 0.0, 1e6
    corr[missing[:, 0] | missing[:, 1], 0] = 0.0  # a missing entry has no correlations
    corr[missing[:, 1] | missing[:, 2], 1] = 0.0
    folder = _write_shards(tmp_path / "missing", x, sigma, corr, shards=3, row_group=100)
    settings = dict(
        n_components=3,
        method="em",
        epochs=4,
        tol=None,
        dtype="float64",
        device="cpu",
        random_state=1,
        missing="marginalise",
    )
    streamed = XDGMM(**settings).fit(_source(folder, missing="marginalise"))
    in_memory = XDGMM(**settings).fit(x, Xcov=CompactCovariance(sigma, corr, PAIRS))
    np.testing.assert_allclose(streamed.means_, in_memory.means_, rtol=1e-10, atol=1e-12)
    assert streamed.history_[-1]["train_loglik"] == pytest.approx(in_memory.history_[-1]["train_loglik"], rel=1e-12)
    with pytest.raises(ValueError, match="opened with missing='variance', but the model's missing is 'marginalise'"):
        XDGMM(**settings).fit(_source(folder))

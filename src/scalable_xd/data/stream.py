"""Training data streamed from Parquet: a fit whose data never sit in memory whole.

A ``ParquetSource`` reads a Parquet data set (one file, a folder of files, a HATS catalogue) one row group
at a time. An epoch visits the row groups in an order drawn from (seed, epoch) and reads them into a
window of at least ``window_rows`` rows; the window is permuted with a generator drawn from (seed, epoch,
window) and batches are served from its front. Rows left over when a batch needs more stay in the buffer,
join the next window and are permuted with it. Batch sizes are ``batching.batch_bounds``'s, as in memory.

The order depends only on the seed, the epoch, the layout (the row groups and their sizes) and
``window_rows``: a fit resumed from its checkpoint (written after each epoch) reads exactly the batches an
uninterrupted one reads, and ``epoch_rows`` lists them, as row numbers, without reading any data.
Unshuffled epochs (batch EM) and evaluation passes read the row groups in file order.

Memory holds one window, the carried rows and the row group being read, whatever the size of the data set;
noise covariances are built per batch on the fitting device from the compact columns (standard deviations
and correlations, ``noise.CompactCovariance``). Under data-parallel fitting every process reads every
window and keeps its share of each batch, so the global batches, and the result, do not depend on the
number of processes; the price is that each process reads the whole data set (P times the reading).

A shuffle is only as good as its window: rows from one row group arrive together, so the window should
span many row groups (HATS and ``scalable-xd features`` files keep them small; sky-ordered data with
row groups as large as the window give batches from one patch of sky).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .batching import GatheredOnRead, RowsInMemory, batch_bounds, batch_views, generator
from .dataset import GATHER_ROWS, Dataset
from .noise import CompactCovariance, correlation_columns
from .windows import fill_window, take_rows

if TYPE_CHECKING:
    import pyarrow.dataset

# Rows a shuffle window holds by default: about 150 MB of Gaia features.
DEFAULT_WINDOW = 1 << 20


@dataclass(frozen=True)
class _Piece:
    """One row group: where it is, and which rows of the whole data set it holds."""

    fragment: pyarrow.dataset.ParquetFileFragment  # restricted to this row group
    path: str
    group: int  # the row group's number within its file
    start: int
    rows: int


def parquet_files(path) -> list[str]:
    """The Parquet files of a data set, sorted: one file, a folder searched recursively (skipping names that
    start with ``_`` or ``.``, such as ``_metadata``), or a HATS catalogue (its ``dataset`` folder)."""
    path = Path(path)
    if path.is_file():
        return [str(path)]
    if not path.is_dir():
        raise FileNotFoundError(f"no Parquet data at {path}")
    if (path / "dataset").is_dir() and any((path / name).exists() for name in ("properties", "hats.properties")):
        path = path / "dataset"
    files = sorted(
        str(p)
        for p in path.rglob("*.parquet")
        if not any(part.startswith(("_", ".")) for part in p.relative_to(path).parts)
    )
    if not files:
        raise FileNotFoundError(f"no Parquet files under {path}")
    return files


class ParquetSource:
    """Points x from ``x_columns``, their noise from standard deviations ``sigma_columns`` (None: noiseless)
    and correlations ``corr_columns`` of the dimension ``pairs``, read from Parquet a row group at a time.

    Pass it to ``XDGMM.fit`` (as X, and as X_val) and ``XDGMM.score`` in place of arrays (``missing`` as the
    model's: see ``Dataset``). Values are checked
    when the source is opened (``validate``: one pass), and a bad value is named by its row in the whole
    data set and by its file.

    A minibatch epoch reads it through a shuffle window of ``window_rows`` rows (``epoch_batches``); the
    source keeps the last window's memory for its next epoch, in this fit or the next, and frees it with
    itself (a copy, pickled or deep-copied, keeps none): memory never touched costs its first touch, 0.3-0.5
    s a window of 1,048,576 Gaia rows on a virtual machine whose host takes freed memory back.
    """

    def __init__(
        self,
        path,
        x_columns,
        sigma_columns=None,
        corr_columns=(),
        pairs=(),
        *,
        window_rows: int = DEFAULT_WINDOW,
        name: str = "X",
        validate: bool = True,
        missing: str = "variance",
    ):
        import pyarrow.dataset as ds

        if int(window_rows) < 1:
            raise ValueError(f"window_rows must be a positive number of rows, got {window_rows}")
        self.path, self.name, self.window_rows, self.missing = str(path), name, int(window_rows), missing
        self.x_columns = list(x_columns)
        if not self.x_columns:
            raise ValueError("x_columns is empty: name the columns of X (at least one)")
        self.sigma_columns = None if sigma_columns is None else list(sigma_columns)
        self.corr_columns, self.pairs = list(corr_columns), [tuple(p) for p in pairs]
        if self.sigma_columns is not None and len(self.sigma_columns) != len(self.x_columns):
            raise ValueError(f"{len(self.sigma_columns)} sigma columns for {len(self.x_columns)} x columns")
        if len(self.corr_columns) != len(self.pairs) or (self.corr_columns and self.sigma_columns is None):
            raise ValueError("corr_columns needs sigma_columns and one dimension pair (i, j) per column")
        self._columns = self.x_columns + (self.sigma_columns or []) + self.corr_columns
        import pyarrow as pa

        files = parquet_files(path)
        try:
            dataset = ds.dataset(files, format="parquet")
        except (pa.ArrowInvalid, OSError) as err:  # empty, truncated, CSV: pyarrow's message, first line
            raise ValueError(f"{path} is not a readable Parquet data set ({str(err).splitlines()[0][:200]})") from None
        self._pieces = []
        start = 0
        for fragment in dataset.get_fragments():
            try:  # each file's footer is read here: an empty, truncated or foreign file fails, named
                schema = fragment.physical_schema
            except (pa.ArrowInvalid, OSError) as err:
                first = str(err).splitlines()[0]
                why = first.split("': ", 1)[-1][:200]  # pyarrow's reason, without its own copy of the path
                raise ValueError(f"{name}: {fragment.path} is not a readable Parquet file ({why})") from None
            self._check_columns(fragment.path, schema)
            for number, group in enumerate(fragment.split_by_row_group()):
                rows = group.row_groups[0].num_rows
                if rows:
                    self._pieces.append(_Piece(group, fragment.path, number, start, rows))
                    start += rows
        self._n = start
        if self._n == 0:
            raise ValueError(f"{path} holds no rows")
        self._starts = np.array([piece.start for piece in self._pieces] + [self._n])
        self._sums: np.ndarray | None = None  # every column's sum (``validate``), for ``digest_bytes``
        self._kept: list = []  # [the last shuffle window's memory], for the next epoch's (``epoch_batches``)
        if validate:
            self.validate()

    def __getstate__(self) -> dict:
        """The source less the memory it keeps for its next shuffle window (``_kept``)."""
        return {**self.__dict__, "_kept": []}

    def _check_columns(self, path, schema) -> None:
        """Every column this source reads is in the file at ``path`` (of ``schema``), and numeric."""
        import pyarrow as pa

        missing = [column for column in self._columns if column not in schema.names]
        if missing:
            raise ValueError(
                f"{path} lacks the columns {', '.join(missing[:5])}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            )
        for column in self._columns:
            kind = schema.field(column).type
            if not (pa.types.is_floating(kind) or pa.types.is_integer(kind)):
                raise ValueError(f"{path}: column {column} holds {kind}, not numbers")

    # ------------------------------------------------------------------ shape

    def __len__(self) -> int:
        return self._n

    @property
    def obs_dim(self) -> int:
        return len(self.x_columns)

    @property
    def model_dim(self) -> int:
        return self.obs_dim

    @property
    def total_weight(self) -> float:
        return float(self._n)

    @property
    def layout(self) -> list[tuple[str, int, int]]:
        """(file, row group, rows) of every row group, in file order: what, with ``window_rows``, fixes the
        order of every epoch."""
        return [(piece.path, piece.group, piece.rows) for piece in self._pieces]

    # ------------------------------------------------------------------ reading

    def _read_columns(self, piece: _Piece) -> dict:
        """One row group's columns, one array each, under "x", "sigma" and "corr" (x and sigma as float64,
        correlations in their stored precision, float32 for features files), plus the rows' numbers in the
        whole data set under "row"."""
        table = piece.fragment.to_table(columns=self._columns)

        def columns(names, dtype=np.float64):
            arrays = [table.column(c).to_numpy(zero_copy_only=False) for c in names]
            return [a.astype(np.result_type(a.dtype, dtype), copy=False) for a in arrays]

        out = {"row": np.arange(piece.start, piece.start + piece.rows), "x": columns(self.x_columns)}
        if self.sigma_columns is not None:
            out["sigma"] = columns(self.sigma_columns)
            out["corr"] = columns(self.corr_columns, np.float32)
        return out

    def _read(self, piece: _Piece) -> dict:
        """One row group (``_read_columns``) with each kind's columns side by side in one array."""
        out = self._read_columns(piece)
        for key in ("x", "sigma", "corr"):
            if key in out:
                out[key] = np.stack(out[key], axis=1) if out[key] else np.empty((piece.rows, 0))
        return out

    def _dataset(self, block: dict, name: str | None = None, validate: bool = False) -> Dataset:
        noise = None
        if self.sigma_columns is not None:
            noise = CompactCovariance(block["sigma"], block["corr"], self.pairs)
        return Dataset(block["x"], noise, name=name or self.name, validate=validate, missing=self.missing)

    def _tensors(self, block: dict, device, dtype):
        """(x, S, R, observed) of a block of rows (see ``Dataset``)."""
        data = self._dataset(block)
        return (*data.batch(slice(None), device, dtype), data.batch_observed(slice(None), device))

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Check every row (finite values, valid standard deviations and correlations), naming the first
        bad one by its row in the whole data set and its file; also sums every column (x, sigma,
        correlations) for ``digest_bytes``, which vouches for all of them."""
        sums = np.zeros(0)
        for piece in self._pieces:
            block = self._read(piece)
            with _rows_named_from(piece):
                self._dataset(block, validate=True)
            columns = [block[key].astype(np.float64).sum(axis=0) for key in ("x", "sigma", "corr") if key in block]
            sums = np.concatenate(columns) + (sums if len(sums) else 0.0)
        self._sums = sums

    def check_range(self, dtype: torch.dtype, name: str | None = None) -> None:
        """``Dataset.check_range`` over every row group (see there), naming the row in the whole data set."""
        for piece in self._pieces:
            with _rows_named_from(piece):
                self._dataset(self._read(piece)).check_range(dtype, name or self.name)

    # ------------------------------------------------------------------ what a fit asks of its data

    def _epoch_blocks(self, batch_size: int, epoch: int, seed: int, shuffle: bool, read, kept: list | None = None):
        """Yield (window, the batch's rows in it, whether the window is refilled before the next batch) per
        global batch of the epoch, the window an array of records filled by ``read(piece)``.

        The window holds the rows carried over from the last one, then whole row groups up to
        ``window_rows``; it is filled in place (its size is known from the metadata), in the memory of the
        last window, allocated for the largest window the epoch can have, so memory peaks at one window
        plus one row group. Batches are taken in the order of a permutation of the window. ``kept``: [the
        memory a window may be filled in] or [], left holding the last window's when the epoch is done."""
        order = list(range(len(self._pieces)))
        if shuffle:
            order = torch.randperm(len(self._pieces), generator=generator(seed, epoch)).tolist()
        pending = collections.deque(order)
        window = np.empty(0)
        order_in_window, served = np.arange(0), 0
        number = 0
        sizes = [stop - start for start, stop in batch_bounds(self._n, batch_size)]
        # the most rows a window can hold: fewer than window_rows and one row group, plus fewer than a batch
        # carried over; never more than the data set
        capacity = min(self._n, self.window_rows + max(piece.rows for piece in self._pieces) + max(sizes))
        memory = kept if kept is not None else []
        for at, size in enumerate(sizes):
            while len(order_in_window) - served < size:  # refill: what is left, then the next row groups
                carried = take_rows(window, order_in_window[served:]) if len(window) else None
                if len(window):  # its memory is refilled, not allocated again
                    memory[:] = [window]
                window = np.empty(0)
                chosen, filled = [], 0
                while pending and filled < self.window_rows:
                    chosen.append(pending.popleft())
                    filled += self._pieces[chosen[-1]].rows
                window = fill_window([self._pieces[i] for i in chosen], carried, read, memory, capacity)
                order_in_window = np.arange(len(window))
                if shuffle:
                    order_in_window = torch.randperm(len(window), generator=generator(seed, epoch, number, 2)).numpy()
                served, number = 0, number + 1
            take = order_in_window[served : served + size]
            served += size
            yield window, take, at + 1 < len(sizes) and len(order_in_window) - served < sizes[at + 1]
        if len(window):
            memory[:] = [window]

    def epoch_rows(self, batch_size: int, epoch: int, seed: int, shuffle: bool = True):
        """Yield the row numbers (in the whole data set) of each batch of an epoch, reading no data."""

        def rows_only(piece):
            return {"row": np.arange(piece.start, piece.start + piece.rows)}

        for window, take, _ in self._epoch_blocks(batch_size, epoch, seed, shuffle, rows_only):
            yield np.take(window["row"], take)

    def epoch_batches(
        self, batch_size: int, epoch: int, seed: int, shuffle: bool, group, device, dtype, skip=0, in_place=False
    ):
        """Yield a ``Batch`` per global batch of an epoch after the first ``skip`` (whose windows are still
        read: the rows they carry over belong to later batches): this process's share of it (see the
        module). ``in_place`` (on the CPU): each batch names its rows in the window
        (``batching.GatheredOnRead``), which the CPU's pass reads there; the last batch before a refill is
        gathered, and the window's memory is refilled with the next rows, so a batch read in place is
        valid until the batch after its window's last is asked for (reading it later raises). Otherwise, as
        ``Dataset.epoch_batches`` does, the shares of many batches are made tensors at once (``GATHER_ROWS``)
        and each batch is a view of them."""
        in_place = in_place and self._in_place(device)
        columns = correlation_columns(self.obs_dim, self.pairs)
        shares, held = [], 0
        read_in_place: list[GatheredOnRead] = []  # the window's batches named in it: expired before its refill
        kept, self._kept = self._kept, []  # taken: an epoch served beside this one allocates its own
        for number, (window, take, refilled) in enumerate(
            self._epoch_blocks(batch_size, epoch, seed, shuffle, self._read_columns, kept)
        ):
            size = len(take)
            rows = take[group.share(slice(0, size), size)]
            if number < skip:
                pass
            elif in_place and not refilled:
                gather = functools.partial(self._rows_read, window, rows, device, dtype)
                noise = (window["sigma"], window["corr"], columns)
                read_in_place.append(GatheredOnRead(size, RowsInMemory(window["x"], noise, rows), gather))
                yield read_in_place[-1]
            else:
                shares.append((size, take_rows(window, rows)))
                held += len(rows)
                if in_place or held >= GATHER_ROWS:
                    yield from self._batches(shares, device, dtype)
                    shares, held = [], 0
            if refilled:
                for batch in read_in_place:
                    batch.expire("its shuffle window has since been refilled with other rows")
                read_in_place = []
            window = None  # not held here while the next window is filled
        yield from self._batches(shares, device, dtype)
        for batch in read_in_place:
            batch.expire("its epoch is over, and its shuffle window's memory serves the next")
        self._kept = kept

    def _in_place(self, device) -> bool:
        """Whether batches can be read in place from the window (``epoch_batches``): on the CPU, with noise
        columns and every entry measured (``missing="variance"``)."""
        return torch.device(device).type == "cpu" and self.sigma_columns is not None and self.missing == "variance"

    def _rows_read(self, window: np.ndarray, rows: np.ndarray, device, dtype) -> tuple:
        """(x, S, None) of a batch read in place, gathered (every entry is measured: ``_in_place``)."""
        x, S, _, _ = self._tensors(take_rows(window, rows), device, dtype)
        return x, S, None

    def _batches(self, shares: list, device, dtype):
        """A ``Batch`` for each (size, block) of ``shares``, from the tensors of all their rows."""
        if not shares:
            return
        x, S, R, observed = self._tensors(
            {k: np.concatenate([part[k] for _, part in shares]) for k in shares[0][1]}, device, dtype
        )
        yield from batch_views([(size, len(part["row"])) for size, part in shares], (x, S, R, None, observed))

    def scan(self, rows: slice, batch_size: int, device, dtype):
        """Yield (first row, x, S, None, None, observed) over ``rows`` in file order, ``batch_size`` rows at a
        time (a batch never spans two row groups)."""
        for piece in self._pieces:
            low, high = max(rows.start, piece.start), min(rows.stop, piece.start + piece.rows)
            if low >= high:
                continue
            block = self._read(piece)
            for first in range(low, high, batch_size):
                part = slice(first - piece.start, min(first + batch_size, high) - piece.start)
                x, S, R, observed = self._tensors({k: v[part] for k, v in block.items()}, device, dtype)
                yield first, x, S, R, None, observed

    def sample(self, rows, name: str) -> Dataset:
        """The rows ``rows`` (sorted row numbers) in memory, in float64, reading only the row groups that
        hold them."""
        rows = np.asarray(rows, dtype=np.int64)
        owners = np.searchsorted(self._starts, rows, side="right") - 1
        blocks = []
        for number in np.unique(owners):
            piece = self._pieces[number]
            block = self._read(piece)
            local = rows[owners == number] - piece.start
            blocks.append({key: value[local] for key, value in block.items()})
        return self._dataset({key: np.concatenate([b[key] for b in blocks]) for key in blocks[0]}, name)

    def digest_bytes(self, rows):
        """Yield what identifies these data for a checkpoint: the layout, ``window_rows`` (both fix the
        epochs' order), the sums of every column (from ``validate``) and the rows ``rows`` in full."""
        if self._sums is None:
            self.validate()
        yield repr((self.layout, self.window_rows, self._columns, self.pairs)).encode()
        yield self._sums.tobytes()
        x, S, _ = self.sample(rows, self.name).batch(slice(None), "cpu", torch.float64)
        yield x.numpy().tobytes()
        yield S.numpy().tobytes()


@contextlib.contextmanager
def _rows_named_from(piece: _Piece):
    """Turn "row N" in a ValueError raised for one row group into the row of the whole data set and the
    file it is in."""
    try:
        yield
    except ValueError as error:
        if "row " not in str(error):
            raise
        message = re.sub(r"row (\d+)", lambda m: f"row {piece.start + int(m.group(1))}", str(error), count=1)
        raise ValueError(f"{message} (in {piece.path}, row group {piece.group})") from None

"""A streamed epoch's shuffle windows (``stream.ParquetSource``) as arrays of records: filled in place from
the rows carried over and the row groups read, and the rows of a batch taken from them."""

from __future__ import annotations

import numpy as np


def fill_window(pieces, carried: dict | None, read, spare: list, capacity: int) -> np.ndarray:
    """The carried rows (arrays, from ``take_rows``) followed by the row groups ``pieces`` (as
    ``_read_columns`` gives them), read into one array of records (a row's columns side by side: a
    batch's rows, taken from anywhere in the window, are then a few cache lines each, read in about half
    the time of four arrays' rows). Each column is written straight into its
    place in the records. The window is the memory of the last one (``spare``: [its array] or []) where
    that has room and the same fields, and is allocated otherwise, for ``capacity`` rows (the largest
    window of the epoch), so that every later window fits: fresh memory costs its first touch (~0.1-0.3
    s for a window of 1,048,576 Gaia rows on a 2-core VM), as much as the filling."""

    def blocks():
        if carried is not None:
            yield carried
        for piece in pieces:
            yield read(piece)

    def kind(value):  # a field's (dtype, shape) from an array or a list of columns
        if isinstance(value, list):
            return (np.result_type(*value) if value else np.float64), (len(value),)
        return value.dtype, value.shape[1:]

    total = sum(piece.rows for piece in pieces) + (0 if carried is None else len(carried["row"]))
    window = np.empty(0)
    at = 0
    for block in blocks():
        rows = len(block["row"])
        if not len(window):
            dtype = np.dtype([(key, *kind(value)) for key, value in block.items()])
            memory = spare.pop() if spare else np.empty(0)
            memory = memory if memory.base is None else memory.base  # the whole allocation
            if memory.dtype != dtype or len(memory) < total:
                memory = np.empty(0)  # freed before the new one is allocated
                memory = np.empty(max(total, capacity), dtype)
            window = memory[:total]
        for key, value in block.items():
            place = window[key][at : at + rows]
            if isinstance(value, list):
                for number, column in enumerate(value):
                    place[:, number] = column
            else:
                place[...] = value
        at += rows
    return window


def take_rows(window: np.ndarray, rows: np.ndarray) -> dict:
    """The rows ``rows`` of a window of records (``fill_window``), as a dict of one array a column.
    ``np.take`` gathers rows ~3x faster than indexing with the row numbers."""
    records = np.take(window, rows)
    return {key: records[key] for key in window.dtype.names or ()}

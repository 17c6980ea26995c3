"""Feature files on disk: the raw catalogue in (a Parquet file, a folder of chunks or a query manifest),
train/val/test Parquet files out, one raw chunk in memory at a time.

Rows go to train/val/test (80/10/10) by a hash of (random_index, split seed): deterministic per star, so
chunks can be processed one at a time in any order. A file of the wrong kind or without the needed
columns is refused with the file and the missing columns named.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pandas as pd

from ...io import atomic_path, write_json
from .features import FEATURES, REPAIRS, TRUE_COLUMNS, Features, compute_features
from .schema import CORRELATION_PAIRS, CORRELATIONS, QUERY_COLUMNS

SPLITS = {"train": range(0, 8), "val": range(8, 9), "test": range(9, 10)}
# Rows per Parquet row group of a features file: small enough that a streamed fit's shuffle window
# (``stream``) draws from many row groups, large enough that reading one is efficient.
ROW_GROUP = 65_536


def split_of(random_index: np.ndarray, seed: int) -> np.ndarray:
    """'train', 'val' or 'test' for each star: a splitmix64 hash of (random_index, seed) modulo 10."""
    with np.errstate(over="ignore"):
        z = random_index.astype(np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    bucket = (z % np.uint64(10)).astype(np.int64)
    out = np.empty(len(bucket), dtype=object)
    for name, buckets in SPLITS.items():
        out[np.isin(bucket, list(buckets))] = name
    return out


# The columns of a features file, as ``features_to_arrow`` writes them (the truth columns only on a mock).
FEATURE_FILE_COLUMNS = (
    ("source_id", "random_index")
    + tuple(f"x_{name}" for name in FEATURES)
    + tuple(f"sigma_{name}" for name in FEATURES)
    + tuple(name for name, _, _ in CORRELATIONS)
    + ("n_missing",)
)


def features_to_arrow(features: Features):
    import pyarrow as pa

    data = {"source_id": features.source_id, "random_index": features.random_index}
    for k, name in enumerate(FEATURES):
        data[f"x_{name}"] = features.X[:, k]
    for k, name in enumerate(FEATURES):
        data[f"sigma_{name}"] = features.sigma[:, k]
    for p, (name, _, _) in enumerate(CORRELATIONS):
        data[name] = features.corr[:, p].astype(np.float32)
    data["n_missing"] = features.n_missing
    if features.true is not None:
        for k, name in enumerate(TRUE_COLUMNS):
            data[name] = features.true[:, k]
    return pa.table(data)


def _require_columns(path, what: str, names, required, hint: str | None) -> None:
    """Raise ValueError naming the file and the first missing columns, instead of a schema dump."""
    missing = [name for name in required if name not in names]
    if missing:
        listed = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{path} is not {what}: it lacks the columns {listed}" + (f" ({hint})" if hint else ""))


def read_features(path) -> Features:
    """Features stored by ``scalable-xd features`` (one split's Parquet file)."""
    import pyarrow.parquet as pq

    names = pq.read_schema(path).names
    hint = "it looks like a raw catalogue: run `scalable-xd features` on it first" if "ra" in names else None
    _require_columns(path, "a features file written by `scalable-xd features`", names, FEATURE_FILE_COLUMNS, hint)
    table = pq.read_table(path)
    meta = json.loads((table.schema.metadata or {}).get(b"scalable_xd", b"{}"))

    def columns(names, dtype):
        return np.stack([table.column(name).to_numpy().astype(dtype, copy=False) for name in names], axis=1)

    return Features(
        X=columns([f"x_{name}" for name in FEATURES], np.float64),
        sigma=columns([f"sigma_{name}" for name in FEATURES], np.float64),
        corr=columns([name for name, _, _ in CORRELATIONS], np.float64),
        n_missing=table.column("n_missing").to_numpy().astype(np.int8, copy=False),
        source_id=table.column("source_id").to_numpy().astype(np.int64, copy=False),
        random_index=table.column("random_index").to_numpy().astype(np.int64, copy=False),
        mode=meta.get("mode", "unknown"),
        true=columns(TRUE_COLUMNS, np.float64) if TRUE_COLUMNS[0] in table.column_names else None,
    )


def features_source(
    path, window_rows: int | None = None, name: str = "X", validate: bool = True, missing: str = "variance"
):
    """Features files (one split's Parquet file, a folder of them or a HATS catalogue of features) as a
    ``stream.ParquetSource``: a fit reads them a window of ``window_rows`` rows at a time."""
    from ...stream import DEFAULT_WINDOW, ParquetSource

    return ParquetSource(
        path,
        [f"x_{n}" for n in FEATURES],
        [f"sigma_{n}" for n in FEATURES],
        [n for n, _, _ in CORRELATIONS],
        CORRELATION_PAIRS,
        window_rows=window_rows or DEFAULT_WINDOW,
        name=name,
        validate=validate,
        missing=missing,
    )


def split_facts(path) -> dict:
    """What a fit's report needs of a features split without loading it: rows, missing entries (summed a
    row group at a time), the covariance mode and whether it holds true values."""
    import pyarrow.dataset as ds

    from ...stream import parquet_files

    dataset = ds.dataset(parquet_files(path), format="parquet")
    _require_columns(
        path, "a features file written by `scalable-xd features`", dataset.schema.names, ("n_missing",), None
    )
    rows = missing = 0
    for batch in dataset.to_batches(columns=["n_missing"]):
        rows += batch.num_rows
        missing += int(np.asarray(batch.column(0), dtype=np.int64).sum())
    meta = json.loads((dataset.schema.metadata or {}).get(b"scalable_xd", b"{}"))
    return {
        "n": rows,
        "missing_entries": missing,
        "mode": meta.get("mode", "unknown"),
        "true_values": TRUE_COLUMNS[0] in dataset.schema.names,
    }


def _raw_dataset(path):
    """A raw catalogue: one Parquet file, a directory of chunk files, a HATS catalogue (``bulk``) or a query
    manifest (.json)."""
    import pyarrow.dataset as ds

    path = Path(path)
    if path.suffix == ".json":
        try:
            chunks = json.loads(path.read_text())["chunks"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path} is not a query manifest (a JSON object listing its chunks)") from None
        dataset = ds.dataset([str(path.parent / c) for c in chunks], format="parquet")
    else:  # one file, a folder of chunks or a HATS catalogue (see ``stream.parquet_files``)
        from ...stream import parquet_files

        dataset = ds.dataset(parquet_files(path), format="parquet")
    names = dataset.schema.names
    hint = "it looks like a features file, which is already processed" if "x_ra" in names else None
    _require_columns(path, "a raw Gaia catalogue", names, QUERY_COLUMNS, hint)
    return dataset


def read_raw(path) -> pd.DataFrame:
    """A whole raw catalogue (see ``_raw_dataset``) with the query's columns, in memory."""
    return _raw_dataset(path).to_table(columns=list(QUERY_COLUMNS)).to_pandas()


def write_feature_splits(raw_path, out_dir, *, mode: str = "corrected", split_seed: int = 0, progress=True) -> dict:
    """Features of a raw catalogue written as ``train/val/test.parquet`` plus a ``features.json`` summary.

    Reads the raw data one Parquet fragment (download chunk) at a time, so memory holds one chunk; every
    output file is written atomically. Returns the summary (rows per split, missing entries, bad rows).
    """
    import pyarrow.parquet as pq
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    dataset = _raw_dataset(raw_path)
    fragments = list(dataset.get_fragments())
    if not fragments:
        raise ValueError(f"no Parquet data found at {raw_path}")
    has_truth = all(name in dataset.schema.names for name in TRUE_COLUMNS)
    columns = list(QUERY_COLUMNS) + (list(TRUE_COLUMNS) if has_truth else [])
    counts = dict.fromkeys(REPAIRS, 0)
    rows = dict.fromkeys(SPLITS, 0)
    missing_entries = dict.fromkeys(SPLITS, 0)
    schema_meta = {b"scalable_xd": json.dumps({"mode": mode, "split_seed": split_seed}).encode()}
    schema = features_to_arrow(_empty_features(mode, has_truth)).schema.with_metadata(schema_meta)
    with contextlib.ExitStack() as stack:  # each writer closes before its file moves into place
        writers = {}
        for name in SPLITS:
            tmp = stack.enter_context(atomic_path(out_dir / f"{name}.parquet"))
            writers[name] = stack.enter_context(pq.ParquetWriter(tmp, schema))
        for fragment in tqdm(fragments, desc="features", unit="chunk", disable=not progress or None):
            features = compute_features(fragment.to_table(columns=columns), mode)
            for key in counts:
                counts[key] += features.counts[key]
            splits = split_of(features.random_index, split_seed)
            for name, writer in writers.items():
                part = features.subset(splits == name)
                table = features_to_arrow(part).replace_schema_metadata(schema_meta)
                writer.write_table(table, row_group_size=ROW_GROUP)
                rows[name] += len(part)
                missing_entries[name] += int(part.n_missing.sum())
    summary = {
        "mode": mode,
        "split_seed": split_seed,
        "features": list(FEATURES),
        "true_values": has_truth,
        "rows": rows,
        "missing_entries": missing_entries,
        "bad_rows": counts,
    }
    write_json(out_dir / "features.json", summary)
    return summary


def _empty_features(mode: str, has_truth: bool) -> Features:
    empty = np.empty((0, len(FEATURES)))
    return Features(
        empty,
        empty,
        np.empty((0, len(CORRELATIONS))),
        np.empty(0, np.int8),
        np.empty(0, np.int64),
        np.empty(0, np.int64),
        mode,
        {},
        empty if has_truth else None,
    )

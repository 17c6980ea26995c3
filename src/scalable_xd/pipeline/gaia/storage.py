"""From a raw Gaia catalogue (a Parquet file, a folder of chunks, a HATS catalogue or a query manifest) to
the features files (``features_file``), one raw chunk in memory at a time. A file of the wrong kind or
without the needed columns is refused with the file and the missing columns named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from ..features_file import require_columns, write_splits
from .features import REPAIRS, TRUE_COLUMNS, compute_features
from .schema import GAIA_DR2, QUERY_COLUMNS

SPEC = GAIA_DR2  # the survey's features (``pipeline.surveys``)


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
        from ...data.stream import parquet_files

        dataset = ds.dataset(parquet_files(path), format="parquet")
    names = dataset.schema.names
    hint = "it looks like a features file, which is already processed" if "x_ra" in names else None
    require_columns(path, "a raw Gaia catalogue", names, QUERY_COLUMNS, hint)
    return dataset


def read_raw(path) -> pd.DataFrame:
    """A whole raw catalogue (see ``_raw_dataset``) with the query's columns, in memory."""
    return _raw_dataset(path).to_table(columns=list(QUERY_COLUMNS)).to_pandas()


def write_feature_splits(raw_path, out_dir, *, mode: str = "corrected", split_seed: int = 0, progress=True) -> dict:
    """Features of a raw catalogue written as ``train/val/test.parquet``, and their summary (the survey
    module of ``surveys``: ``steps.features`` writes the summary beside them).

    Reads the raw data one Parquet fragment (download chunk) at a time, so memory holds one chunk; every
    output file is written atomically. Returns the summary (rows per split, missing entries, bad rows).
    """
    from tqdm.auto import tqdm

    dataset = _raw_dataset(raw_path)
    fragments = list(dataset.get_fragments())
    if not fragments:
        raise ValueError(f"no Parquet data found at {raw_path}")
    has_truth = all(name in dataset.schema.names for name in TRUE_COLUMNS)
    columns = list(QUERY_COLUMNS) + (list(TRUE_COLUMNS) if has_truth else [])
    counts = dict.fromkeys(REPAIRS, 0)

    def chunks():
        for fragment in tqdm(fragments, desc="features", unit="chunk", disable=not progress or None):
            features = compute_features(fragment.to_table(columns=columns), mode)
            for key in counts:
                counts[key] += features.counts[key]
            yield features

    rows, missing_entries = write_splits(chunks(), out_dir, GAIA_DR2, mode, split_seed, has_truth)
    summary = {
        "mode": mode,
        "split_seed": split_seed,
        "features": list(GAIA_DR2.names),
        "true_values": has_truth,
        "rows": rows,
        "missing_entries": missing_entries,
        "bad_rows": counts,
    }
    return summary

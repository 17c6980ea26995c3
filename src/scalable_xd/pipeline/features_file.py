"""The features file: the survey-neutral table that every fit step of the workflow reads.

A survey describes its features once, as a ``FeatureSpec`` (feature names and units, which pairs of
features have a correlation column, the roles some play, such as sky position or magnitude, for the
figures that need them, and the labels figures give them); Gaia DR2's is ``gaia.schema.GAIA_DR2``. A
features file then holds, per star, ``source_id``, ``random_index``, the values ``x_<feature>``, the
standard deviations ``sigma_<feature>``, the correlation columns, ``n_missing`` (entries given the missing
variance of ``data.missing.MISSING_VARIANCE``) and, on a mock, the noise-free values ``true_<feature>``. The
spec travels in the file's metadata, so reading a file needs nothing but the file. Another survey is a new
spec and a module that turns its catalogue into ``Features`` chunks for ``write_splits``.

Rows go to train/val/test (80/10/10) by a hash of (random_index, split seed): deterministic per star, so
chunks can be processed one at a time in any order.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..files import atomic_path

SPLITS = {"train": range(0, 8), "val": range(8, 9), "test": range(9, 10)}
# Rows per Parquet row group of a features file: small enough that a streamed fit's shuffle window
# (``stream``) draws from many row groups, large enough that reading one is efficient.
ROW_GROUP = 65_536
METADATA_KEY = b"scalable_xd"
WHAT = "a features file written by `scalable-xd features`"
# The roles a feature can play, which figures ask for (``pipeline.report.FIGURE_ROLES``): sky position in
# degrees (ICRS), parallax in mas, an apparent magnitude and a colour in magnitudes.
ROLES = ("ra", "dec", "parallax", "magnitude", "colour")


@dataclass(frozen=True)
class FeatureSpec:
    """A survey's features: ``names`` with their ``units`` (None where unitless), ``correlations``,
    (column, i, j) for each pair of features i < j whose noise correlation the survey publishes, ``roles``,
    (role, feature name) for the features that play one of ``ROLES``, and ``labels``, what figures call each
    feature (by default its name and unit)."""

    survey: str
    names: tuple[str, ...]
    units: tuple[str | None, ...]
    correlations: tuple[tuple[str, int, int], ...]
    roles: tuple[tuple[str, str], ...] = ()
    labels: tuple[str, ...] = ()

    def __post_init__(self):
        if len(self.units) != len(self.names):
            raise ValueError(f"{self.survey}: {len(self.names)} feature names but {len(self.units)} units")
        for column, i, j in self.correlations:
            if not 0 <= i < j < len(self.names):
                raise ValueError(f"{self.survey}: correlation {column} couples features {i} and {j}")
        for role, name in self.roles:
            if role not in ROLES:
                raise ValueError(f"{self.survey}: unknown role {role!r} (the roles are {', '.join(ROLES)})")
            if name not in self.names:
                raise ValueError(f"{self.survey}: role {role} names {name!r}, not one of its features")
        if len({role for role, _ in self.roles}) != len(self.roles):
            raise ValueError(f"{self.survey}: a role is given twice in {self.roles}")
        if self.labels and len(self.labels) != len(self.names):
            raise ValueError(f"{self.survey}: {len(self.names)} feature names but {len(self.labels)} labels")

    def has(self, *roles: str) -> bool:
        """Whether some feature plays each of ``roles``."""
        played = {role for role, _ in self.roles}
        return all(role in played for role in roles)

    def feature(self, role: str) -> str:
        """The name of the feature that plays ``role``; a ValueError naming the survey where none does."""
        for played, name in self.roles:
            if played == role:
                return name
        raise ValueError(f"{self.survey}: no feature plays the role {role} (its roles: {dict(self.roles)})")

    def index(self, role: str) -> int:
        """The column of the feature that plays ``role`` (see ``feature``)."""
        return self.names.index(self.feature(role))

    @property
    def feature_labels(self) -> tuple[str, ...]:
        """What figures call each feature: ``labels``, or each name with its unit in brackets."""
        if self.labels:
            return self.labels
        return tuple(name if unit is None else f"{name} [{unit}]" for name, unit in zip(self.names, self.units))

    @property
    def x_columns(self) -> tuple[str, ...]:
        return tuple(f"x_{name}" for name in self.names)

    @property
    def sigma_columns(self) -> tuple[str, ...]:
        return tuple(f"sigma_{name}" for name in self.names)

    @property
    def true_columns(self) -> tuple[str, ...]:
        return tuple(f"true_{name}" for name in self.names)

    @property
    def corr_columns(self) -> tuple[str, ...]:
        return tuple(column for column, _, _ in self.correlations)

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        return tuple((i, j) for _, i, j in self.correlations)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column of a features file but the truth (written on a mock only)."""
        return ("source_id", "random_index", *self.x_columns, *self.sigma_columns, *self.corr_columns, "n_missing")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> FeatureSpec:
        """The spec a features file's metadata holds; a ValueError naming what is missing or malformed."""
        if not isinstance(data, dict):
            raise ValueError("its feature spec is not a mapping")
        missing = [key for key in ("survey", "names", "units", "correlations") if key not in data]
        if missing:
            raise ValueError(f"its feature spec lacks {', '.join(missing)}")
        try:
            pairs = tuple((str(c), int(i), int(j)) for c, i, j in data["correlations"])
            roles = tuple((str(role), str(name)) for role, name in data.get("roles", ()))  # absent: older files
        except (TypeError, ValueError):
            raise ValueError(
                "its feature spec's correlations must be [column, i, j] triples, its roles pairs"
            ) from None
        labels = tuple(str(label) for label in data.get("labels", ()))
        return cls(data["survey"], tuple(data["names"]), tuple(data["units"]), pairs, roles, labels)


@dataclass
class Features:
    """Per star: values X (N, D), standard deviations (N, D) and correlations (N, P) in ``spec``'s order,
    the number of missing entries, the ids, the covariance ``mode`` the noise was built in, the counts of
    repaired rows, and the noise-free values where the catalogue knows them (a mock)."""

    spec: FeatureSpec
    X: np.ndarray
    sigma: np.ndarray
    corr: np.ndarray
    n_missing: np.ndarray
    source_id: np.ndarray
    random_index: np.ndarray
    mode: str
    counts: dict = field(default_factory=dict)
    true: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.X)

    def covariance(self):
        """The noise as a ``noise.CompactCovariance``, which builds the D x D matrices batch by batch."""
        from ..data.noise import CompactCovariance  # torch: not imported where only the spec is needed

        return CompactCovariance(self.sigma, self.corr, self.spec.pairs)

    def subset(self, rows) -> Features:
        return Features(
            self.spec,
            self.X[rows],
            self.sigma[rows],
            self.corr[rows],
            self.n_missing[rows],
            self.source_id[rows],
            self.random_index[rows],
            self.mode,
            {},
            None if self.true is None else self.true[rows],
        )

    @classmethod
    def empty(cls, spec: FeatureSpec, mode: str, has_truth: bool) -> Features:
        values = np.empty((0, len(spec.names)))
        none = np.empty(0, np.int64)
        corr = np.empty((0, len(spec.correlations)))
        return cls(
            spec, values, values, corr, np.empty(0, np.int8), none, none, mode, {}, values if has_truth else None
        )


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


def features_to_arrow(features: Features):
    import pyarrow as pa

    spec = features.spec
    data = {"source_id": features.source_id, "random_index": features.random_index}
    data.update(zip(spec.x_columns, features.X.T))
    data.update(zip(spec.sigma_columns, features.sigma.T))
    data.update((name, column.astype(np.float32)) for name, column in zip(spec.corr_columns, features.corr.T))
    data["n_missing"] = features.n_missing
    if features.true is not None:
        data.update(zip(spec.true_columns, features.true.T))
    return pa.table(data)


def file_metadata(spec: FeatureSpec, mode: str, split_seed: int) -> dict:
    """The Parquet schema metadata that makes a table a features file (``features_source`` reads it)."""
    return {METADATA_KEY: json.dumps({"mode": mode, "split_seed": split_seed, "spec": spec.as_dict()}).encode()}


def write_splits(
    chunks: Iterable[Features], out_dir, spec: FeatureSpec, mode: str, split_seed: int, has_truth: bool
) -> tuple[dict, dict]:
    """Write ``train/val/test.parquet`` in ``out_dir`` from chunks of features, each star to the split of
    its ``random_index``, every file atomically; returns the rows and the missing entries per split."""
    import pyarrow.parquet as pq

    rows = dict.fromkeys(SPLITS, 0)
    missing_entries = dict.fromkeys(SPLITS, 0)
    meta = file_metadata(spec, mode, split_seed)
    schema = features_to_arrow(Features.empty(spec, mode, has_truth)).schema.with_metadata(meta)
    with contextlib.ExitStack() as stack:  # each writer closes before its file moves into place
        writers = {}
        for name in SPLITS:
            tmp = stack.enter_context(atomic_path(Path(out_dir) / f"{name}.parquet"))
            writers[name] = stack.enter_context(pq.ParquetWriter(tmp, schema))
        for features in chunks:
            splits = split_of(features.random_index, split_seed)
            for name, writer in writers.items():
                part = features.subset(splits == name)
                writer.write_table(features_to_arrow(part).replace_schema_metadata(meta), row_group_size=ROW_GROUP)
                rows[name] += len(part)
                missing_entries[name] += int(part.n_missing.sum())
    return rows, missing_entries


def require_columns(path, what: str, names, required, hint: str | None = None) -> None:
    """Raise ValueError naming the file and the first missing columns, instead of a schema dump."""
    missing = [name for name in required if name not in names]
    if missing:
        listed = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{path} is not {what}: it lacks the columns {listed}" + (f" ({hint})" if hint else ""))


def _metadata(path, schema) -> dict:
    """The file's scalable_xd metadata (mode, split seed, spec), or a clear error where it has none."""
    raw = (schema.metadata or {}).get(METADATA_KEY)
    meta = {} if raw is None else json.loads(raw)
    if "spec" not in meta:
        if "ra" in schema.names:
            hint = "it looks like a raw catalogue: run `scalable-xd features` on it first"
        elif "n_missing" in schema.names:
            hint = "no feature spec in its metadata (written by an older version?): run `scalable-xd features` again"
        else:
            hint = f"no feature spec in its metadata, and columns {', '.join(schema.names[:5])} instead of x_<feature>"
        raise ValueError(f"{path} is not {WHAT} ({hint})")
    try:
        FeatureSpec.from_dict(meta["spec"])
    except ValueError as err:
        raise ValueError(f"{path} is not {WHAT}: {err}") from None
    return meta


def read_features(path) -> Features:
    """Features stored by ``scalable-xd features`` (one split's Parquet file)."""
    import pyarrow.parquet as pq

    spec, meta = _checked_spec(path)
    return _features_of(pq.read_table(path), spec, meta)


def iter_features(path, batch_rows: int):
    """The same file's features ``batch_rows`` stars at a time (memory bounded by the batch)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec, meta = _checked_spec(path)
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        yield _features_of(pa.Table.from_batches([batch]), spec, meta)


def read_features_spec(path) -> FeatureSpec:
    """The ``FeatureSpec`` a features file's metadata holds (its columns checked against it)."""
    return _checked_spec(path)[0]


def _checked_spec(path) -> tuple[FeatureSpec, dict]:
    import pyarrow.parquet as pq

    schema = _readable(path, lambda: pq.read_schema(path))
    meta = _metadata(path, schema)
    spec = FeatureSpec.from_dict(meta["spec"])
    require_columns(path, WHAT, schema.names, spec.columns)
    return spec, meta


def _features_of(table, spec: FeatureSpec, meta: dict) -> Features:
    def columns(names, dtype):
        return np.stack([table.column(name).to_numpy().astype(dtype, copy=False) for name in names], axis=1)

    return Features(
        spec,
        X=columns(spec.x_columns, np.float64),
        sigma=columns(spec.sigma_columns, np.float64),
        corr=columns(spec.corr_columns, np.float64),
        n_missing=table.column("n_missing").to_numpy().astype(np.int8, copy=False),
        source_id=table.column("source_id").to_numpy().astype(np.int64, copy=False),
        random_index=table.column("random_index").to_numpy().astype(np.int64, copy=False),
        mode=meta.get("mode", "unknown"),
        true=columns(spec.true_columns, np.float64) if spec.true_columns[0] in table.column_names else None,
    )


def _dataset(path):
    import pyarrow.dataset as ds

    from ..data.stream import parquet_files

    return _readable(path, lambda: ds.dataset(parquet_files(path), format="parquet"))


def _readable(path, read):
    """``read()``, with pyarrow's complaint about a file that is not Parquet (garbage, truncated, a CSV)
    turned into one that names ``path``."""
    import pyarrow as pa

    try:
        return read()
    except pa.ArrowInvalid as err:
        raise ValueError(f"{path} is not {WHAT}: it is not a readable Parquet file ({err})") from None


def features_source(
    path, window_rows: int | None = None, name: str = "X", validate: bool = True, missing: str = "variance"
):
    """Features files (one split's Parquet file, a folder of them or a HATS catalogue of features) as a
    ``stream.ParquetSource``: a fit reads them a window of ``window_rows`` rows at a time."""
    from ..data.stream import DEFAULT_WINDOW, ParquetSource

    spec = FeatureSpec.from_dict(_metadata(path, _dataset(path).schema)["spec"])
    return ParquetSource(
        path,
        list(spec.x_columns),
        list(spec.sigma_columns),
        list(spec.corr_columns),
        spec.pairs,
        window_rows=window_rows or DEFAULT_WINDOW,
        name=name,
        validate=validate,
        missing=missing,
    )


def split_facts(path) -> dict:
    """What a fit's report needs of a features split without loading it: rows, missing entries (summed a
    row group at a time), the covariance mode and whether it holds true values."""
    dataset = _dataset(path)
    meta = _metadata(path, dataset.schema)
    require_columns(path, WHAT, dataset.schema.names, ("n_missing",))
    rows = missing = 0
    for batch in dataset.to_batches(columns=["n_missing"]):
        rows += batch.num_rows
        missing += int(np.asarray(batch.column(0), dtype=np.int64).sum())
    spec = FeatureSpec.from_dict(meta["spec"])
    return {
        "n": rows,
        "missing_entries": missing,
        "mode": meta.get("mode", "unknown"),
        "true_values": spec.true_columns[0] in dataset.schema.names,
    }

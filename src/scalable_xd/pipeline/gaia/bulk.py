"""All of DR2's gaia_source from ESA's bulk files: an index, checked files, one HATS catalogue.

ESA publishes gaia_source as 61,234 gzipped CSV files (``GaiaSource_<first source_id>_<last>.csv.gz``, about
550 GB in all) listed with their MD5 sums in ``MD5SUM.txt`` beside them (``BULK_URL``). A file's header names
the archive's columns in lowercase, a NULL is an empty field and the units are the archive's, so the rows
read from it are the rows the TAP query returns (``query``), column for column.

The workflow (``workflow/rules/bulk.smk``) fetches the index, then each file through Snakemake's HTTP
storage plugin, checks each against its MD5 sum, and converts them once, with ``hats-import``, into a HATS
catalogue (HEALPix-partitioned Parquet; only the query's columns are kept), from which ``features`` and
the fits stream.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import urllib.request
from pathlib import Path

from ...files import atomic_path, write_text
from .schema import QUERY_COLUMNS

BULK_URL = "http://cdn.gea.esac.esa.int/Gaia/gdr2/gaia_source/csv/"
INDEX_NAME = "MD5SUM.txt"
_LINE = re.compile(r"^([0-9a-fA-F]{32})\s+\*?(\S+\.csv\.gz)$")


def parse_index(text: str, where: str = "the index") -> list[tuple[str, str]]:
    """(file name, MD5 sum) of every CSV file an ``MD5SUM.txt`` lists, in its order; other lines (the
    index's own entry) are skipped, a malformed CSV entry is named by its line."""
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line.endswith(".csv.gz"):
            continue
        match = _LINE.match(line)
        if not match:
            raise ValueError(f"{where} line {number} is not '<md5>  <file>.csv.gz': {line[:80]!r}")
        entries.append((Path(match.group(2)).name, match.group(1).lower()))
    if not entries:
        raise ValueError(f"{where} lists no .csv.gz files")
    return entries


def fetch_index(url: str, output, n_files: int = 0, timeout: float = 300.0) -> list[tuple[str, str]]:
    """Download ``url`` (an ``MD5SUM.txt``) and write the entries of its first ``n_files`` files (0: all)
    to ``output``, atomically, in the same format; returns them."""
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        entries = parse_index(reply.read().decode("ascii"), url)
    if n_files:
        entries = entries[:n_files]
    write_text(output, "".join(f"{md5}  {name}\n" for name, md5 in entries))
    return entries


def md5_of(path, block: int = 1 << 22) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as stream:
        while chunk := stream.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def checked_copy(source, index, output) -> None:
    """Copy a downloaded bulk file to ``output`` (atomically) once its MD5 sum matches the index's entry for
    its name (``output``'s name); a mismatch or a file the index does not list is refused, naming both."""
    name = Path(output).name
    expected = dict(parse_index(Path(index).read_text(), str(index))).get(name)
    if expected is None:
        raise ValueError(f"{index} does not list {name}")
    actual = md5_of(source)
    if actual != expected:
        raise ValueError(f"{source} is corrupt or incomplete: MD5 {actual}, the index says {expected} for {name}")
    with atomic_path(output) as tmp:
        shutil.copyfile(source, tmp)


def csv_reader(chunksize: int = 500_000):
    """hats-import's CSV reader for the bulk files: the query's columns only, in the query's dtypes (an
    empty field, a NULL, becomes NaN), each number parsed to the float its digits denote (pandas' default
    parser can be an ulp off, and then the features differ from the TAP query's)."""
    from hats_import.catalog.file_readers import CsvReader

    dtypes = {name: dtype for name, (dtype, _) in QUERY_COLUMNS.items()}
    return CsvReader(
        chunksize=chunksize,
        usecols=list(QUERY_COLUMNS),
        type_map=dtypes,
        compression="gzip",
        float_precision="round_trip",
    )


def import_hats(
    files,
    output,
    *,
    pixel_threshold: int = 1_000_000,
    highest_order: int = 10,
    workers: int = 1,
    progress: bool = False,
) -> Path:
    """Convert the checked bulk files into one HATS catalogue at ``output`` (a folder), partitioned so that
    no HEALPix pixel holds more than ``pixel_threshold`` stars. Written beside ``output`` and moved into
    place when complete, so a failed import leaves nothing that looks finished."""
    from dask.distributed import Client
    from hats_import.catalog.arguments import ImportArguments
    from hats_import.pipeline import pipeline_with_client

    output = Path(output)
    if output.exists():
        raise FileExistsError(f"{output} exists: remove it to import again")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        args = ImportArguments(
            output_artifact_name=output.name,
            output_path=staging,
            input_file_list=[str(f) for f in files],
            file_reader=csv_reader(),
            ra_column="ra",
            dec_column="dec",
            sort_columns="source_id",
            pixel_threshold=pixel_threshold,
            highest_healpix_order=highest_order,
            progress_bar=progress,
            resume=False,
            tmp_dir=staging / "tmp",
            dask_tmp=staging / "dask",
        )
        with Client(
            n_workers=workers, threads_per_worker=1, local_directory=str(staging / "dask"), dashboard_address=":0"
        ) as client:
            pipeline_with_client(args, client)
        os.replace(staging / output.name, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output

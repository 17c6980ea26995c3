"""All of DR2 from ESA's bulk files, tested small: files in the archive's bulk format (gzipped CSV with the
archive's columns, NULLs as empty fields, MD5SUM.txt beside them) served from 127.0.0.1, checked, turned
into a HATS catalogue by hats-import, and from there the same features as the TAP query gives for the same
stars; then the whole workflow on them with the real snakemake and its HTTP storage plugin."""

import contextlib
import functools
import gzip
import hashlib
import json
import threading
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import yaml
from tap_server import MockTapServer
from test_workflow import SMOKE, planned_jobs, snakemake

from scalable_xd.pipeline import steps
from scalable_xd.pipeline.features_file import read_features
from scalable_xd.pipeline.gaia.bulk import checked_copy, parse_index
from scalable_xd.pipeline.gaia.mock import make_mock
from scalable_xd.pipeline.gaia.query import query_gaia
from scalable_xd.pipeline.gaia.schema import QUERY_COLUMNS
from scalable_xd.pipeline.report.metrics import FitMetrics

pytest.importorskip("hats_import", reason="the bulk path needs hats-import (pip install -e '.[catalog]')")
pytestmark = pytest.mark.slow

N_ROWS, N_FILES = 6_000, 3


def write_bulk_files(catalogue, folder: Path, n_files: int) -> list[str]:
    """The catalogue as ESA publishes gaia_source: ordered by source_id, cut into files named by their first
    and last source_id, with columns the query does not use around the ones it does, and an MD5SUM.txt."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = catalogue.sort_values("source_id", ignore_index=True)[list(QUERY_COLUMNS)]
    names, lines = [], []
    for part in np.array_split(np.arange(len(rows)), n_files):
        frame = rows.iloc[part].copy()
        frame.insert(0, "solution_id", 1635721458409799680)
        frame.insert(1, "designation", [f"Gaia DR2 {s}" for s in frame.source_id])
        frame["phot_variable_flag"] = "NOT_AVAILABLE"
        name = f"GaiaSource_{frame.source_id.iloc[0]}_{frame.source_id.iloc[-1]}.csv.gz"
        with gzip.open(folder / name, "wt") as stream:
            frame.to_csv(stream, index=False)  # NaN (a NULL) as an empty field, floats written to round-trip
        names.append(name)
        lines.append(f"{hashlib.md5((folder / name).read_bytes()).hexdigest()}  {name}\n")
    (folder / "MD5SUM.txt").write_text("".join(lines))
    return names


@contextlib.contextmanager
def file_server(folder: Path):
    """A static HTTP server on 127.0.0.1 for ``folder``; yields its URL (ending in /)."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(folder))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def catalogue():
    return make_mock(N_ROWS, seed=3)


@pytest.fixture(scope="module")
def bulk(catalogue, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cdn")
    return folder, write_bulk_files(catalogue, folder, N_FILES)


def test_the_index_is_read_and_bad_lines_named():
    good = "0123456789abcdef0123456789abcdef  GaiaSource_1_2.csv.gz\nfedcba9876543210fedcba9876543210  MD5SUM.txt\n"
    assert parse_index(good) == [("GaiaSource_1_2.csv.gz", "0123456789abcdef0123456789abcdef")]
    with pytest.raises(ValueError, match="index line 3 is not"):
        parse_index(good + "not-an-md5  GaiaSource_3_4.csv.gz\n", "index")
    with pytest.raises(ValueError, match="lists no .csv.gz files"):
        parse_index("fedcba9876543210fedcba9876543210  MD5SUM.txt\n")


def test_a_corrupt_or_unlisted_download_is_refused(bulk, tmp_path):
    folder, names = bulk
    truncated = tmp_path / "download"
    truncated.write_bytes((folder / names[0]).read_bytes()[:-100])
    with pytest.raises(
        ValueError, match=f"corrupt or incomplete: MD5 [0-9a-f]{{32}}, the index says .* for {names[0]}"
    ):
        checked_copy(truncated, folder / "MD5SUM.txt", tmp_path / "csv" / names[0])
    assert not (tmp_path / "csv" / names[0]).exists()
    with pytest.raises(ValueError, match="does not list GaiaSource_9_9.csv.gz"):
        checked_copy(folder / names[0], folder / "MD5SUM.txt", tmp_path / "csv" / "GaiaSource_9_9.csv.gz")
    checked_copy(folder / names[0], folder / "MD5SUM.txt", tmp_path / "csv" / names[0])
    assert (tmp_path / "csv" / names[0]).read_bytes() == (folder / names[0]).read_bytes()


def test_the_bulk_path_gives_the_features_of_the_archive_query(catalogue, bulk, tmp_path):
    folder, names = bulk
    with file_server(folder) as url:  # index -> downloads -> checks -> HATS -> features
        steps.bulk_index(url + "MD5SUM.txt", tmp_path / "MD5SUM.txt")
        for name in names:
            with urllib.request.urlopen(url + name) as reply:
                (tmp_path / "download").write_bytes(reply.read())
            steps.bulk_check(tmp_path / "download", tmp_path / "MD5SUM.txt", tmp_path / "csv" / name)
    steps.hats_catalogue(
        tmp_path / "MD5SUM.txt",
        tmp_path / "csv",
        tmp_path / "hats" / "gaia_dr2",
        pixel_threshold=1500,
        highest_order=4,
        workers=1,
    )
    assert (tmp_path / "hats" / "gaia_dr2" / "properties").exists()
    assert len(list((tmp_path / "hats" / "gaia_dr2" / "dataset").rglob("Npix=*.parquet"))) > 1  # partitioned
    steps.features(tmp_path / "hats" / "gaia_dr2", tmp_path / "from_bulk", "corrected", 0)

    with MockTapServer(catalogue) as server:  # the same stars through the archive's TAP service
        query_gaia(N_ROWS, tmp_path / "chunks", chunk_rows=3_000, tap_url=server.url, backoff=0.01, progress=False)
    steps.features(tmp_path / "chunks", tmp_path / "from_query", "corrected", 0)

    for split in ("train", "val", "test"):
        bulk_split, query_split = (
            read_features(tmp_path / run / f"{split}.parquet") for run in ("from_bulk", "from_query")
        )
        assert len(bulk_split) == len(query_split) > 0
        a, b = np.argsort(bulk_split.source_id), np.argsort(query_split.source_id)
        np.testing.assert_array_equal(bulk_split.source_id[a], query_split.source_id[b])
        for name in ("X", "sigma", "corr", "n_missing"):
            np.testing.assert_array_equal(getattr(bulk_split, name)[a], getattr(query_split, name)[b], err_msg=name)


def test_the_workflow_runs_from_bulk_files_served_over_http(bulk, tmp_path):
    """The real snakemake: the index, two of the three files through the HTTP storage plugin, hats-import,
    features, k-means on a sample, fits streamed from disk (and a cut one in memory), the table. The
    figures and claims after it are the smoke run's (test_workflow.py)."""
    folder, names = bulk
    with file_server(folder) as url:
        config = {
            **SMOKE,
            "name": "bulk",
            "data": {
                "source": "bulk",
                "covariance_mode": "corrected",
                "split_seed": 0,
                "bulk": {"url": url, "n_files": 2, "pixel_threshold": 1500, "highest_order": 4, "workers": 1},
            },
            "init": {**SMOKE["init"], "kmeans_max_rows": 1000},
            "fit": {
                **SMOKE["fit"],
                "methods": ["minibatch_em", "em_cut"],
                "n_components": [4],
                "seeds": [0],
                "stream_window": 700,
            },
            "report": {**SMOKE["report"], "figure_K": 4},
        }
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
        table = "results/bulk/tables/loglik.md"
        output = snakemake(
            tmp_path / "run", "--cores", "2", "--printshellcmds", table, configfile=str(tmp_path / "config.yaml")
        )
    run = tmp_path / "run"
    checked = sorted(p.name for p in (run / "resources" / "gaia_dr2_bulk" / "csv").iterdir())
    assert checked == sorted(names[:2])  # data.bulk.n_files of the index's three
    summary = json.loads((run / "results" / "bulk" / "data" / "features.json").read_text())
    assert sum(summary["rows"].values()) == sum(len(part) for part in np.array_split(np.arange(N_ROWS), N_FILES)[:2])
    fits = [line for line in output.splitlines() if " fit --train " in line]
    cut = [line for line in fits if "--selection none" not in line]  # the selection variants: cut in memory
    assert cut and all("--stream-window 0 " in line for line in cut)
    assert all("--stream-window 700 " in line for line in fits if line not in cut)
    assert all("--max-rows 1000 " in line for line in output.splitlines() if " kmeans --train " in line)
    metrics = FitMetrics.read(run / "results" / "bulk" / "fits" / "minibatch_em" / "K4_seed0" / "metrics.json")
    assert metrics.train["n"] == summary["rows"]["train"] and np.isfinite(metrics.test["loglik"])
    assert (run / "results" / "bulk" / "tables" / "loglik.md").exists()


def test_the_full_catalogue_is_planned_without_the_network(tmp_path):
    """config/gaia_full.yaml: a dry run lists the index, the import and everything after it; the files
    themselves are known once the index (a checkpoint) has run."""
    output = snakemake(tmp_path / "plan", "--dry-run", "--printshellcmds", configfile="gaia_full.yaml")
    jobs = planned_jobs(output)
    assert {"bulk_index": 1, "hats_catalogue": 1, "features": 1, "kmeans": 1, "fit": 2}.items() <= jobs.items()
    assert "bulk-index --url http://cdn.gea.esac.esa.int/Gaia/gdr2/gaia_source/csv/MD5SUM.txt --n-files 0" in output
    fits = [line for line in output.splitlines() if " fit --train " in line]
    assert all("--nproc-per-node 8" in line and "--stream-window 4194304" in line for line in fits)

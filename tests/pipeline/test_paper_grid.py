"""The ten-seed grid's rows, table, paired comparisons and Figure 1, on metrics files written by hand, checked
against numpy and scipy; the long-run driver's bookkeeping on CSVs in a temporary directory."""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
import scipy.stats

from scalable_xd.pipeline.report import paper_grid
from scalable_xd.pipeline.report.metrics import FitMetrics

ROOT = Path(__file__).resolve().parents[2]


def _metrics(tmp_path, method, K, seed, val, cpu):
    """A fit's metrics file: three epochs, validation ``val``, ``cpu`` CPU seconds of training."""
    history = [
        {"epoch": e, "seconds": 1.1 * cpu * e / 2, "cpu_seconds": cpu * e / 2, "train_loglik": val - 1 / (1 + e)}
        for e in range(3)
    ]
    split = {"loglik": val, "loglik_observed": val + 10, "n": 1000}
    metrics = FitMetrics(
        method=method,
        n_components=K,
        seed=seed,
        train_seconds=1.1 * cpu,
        kmeans_seconds=1.0,
        history=history,
        train=split,
        val=split,
        test={**split, "loglik": val - 0.01},
        true={"available": True, "test_true_loglik": val + 1},
        train_cpu_seconds=cpu,
        machine_load=0.1,
        wall_seconds=1.2 * cpu,
        cpu_seconds=cpu + 1,
        threads=2,
        n_iter=2,
        dead_components=seed % 2,
        device="cpu",
    )
    path = tmp_path / f"{method}_{K}_{seed}.json"
    metrics.write(path)
    return path


@pytest.fixture
def grid(tmp_path):
    """Two methods, two K, four seeds; SGD ahead of EM by 0.1 + seed-dependent noise."""
    rng = np.random.default_rng(5)
    paths, truth = [], {}
    for K in (64, 128):
        for seed in range(4):
            base = -26.0 + 0.1 * math.log2(K) + rng.normal(0, 0.05)  # the seed's shared luck
            for method, offset in (("em", 0.0), ("sgd", 0.1 + rng.normal(0, 0.01))):
                truth[(method, K, seed)] = (base + offset, K * (2 if method == "em" else 1) + seed)
                paths.append(_metrics(tmp_path, method, K, seed, *truth[(method, K, seed)]))
    return paths, truth


def test_rows_carry_each_fits_numbers_and_curves(grid):
    paths, truth = grid
    fits = paper_grid.fit_rows(paths)
    assert list(fits.columns) == paper_grid.FIT_COLUMNS
    for row in fits.itertuples():
        assert (row.val, row.train_cpu_seconds) == pytest.approx(truth[(row.method, row.K, row.seed)])
    curves = paper_grid.curve_rows(paths)
    assert len(curves) == 3 * len(paths)
    assert curves.groupby(paper_grid.KEY).cpu_seconds.max().to_dict() == pytest.approx(
        {key: cpu for key, (_, cpu) in truth.items()}
    )


def test_merge_replaces_a_fits_rows_and_keeps_the_rest(tmp_path, grid):
    paths, _ = grid
    csv = tmp_path / "fits.csv"
    paper_grid.merge_rows(csv, paper_grid.fit_rows(paths[:5]), paper_grid.FIT_COLUMNS)
    again = paper_grid.fit_rows(paths[4:])
    again.loc[0, "val"] = -99.0  # paths[4] refitted with another score
    merged = paper_grid.merge_rows(csv, again, paper_grid.FIT_COLUMNS)
    assert len(merged) == len(paths)
    assert merged.duplicated(paper_grid.KEY).sum() == 0
    read = paper_grid.read_rows(csv, paper_grid.FIT_COLUMNS)
    first = paper_grid.fit_rows(paths[4:5]).iloc[0]
    key = (read.method == first.method) & (read.K == first.K) & (read.seed == first.seed)
    assert read[key].val.item() == -99.0
    curves = tmp_path / "curves.csv"
    paper_grid.merge_rows(curves, paper_grid.curve_rows(paths), paper_grid.CURVE_COLUMNS)
    twice = paper_grid.merge_rows(curves, paper_grid.curve_rows(paths[:2]), paper_grid.CURVE_COLUMNS)
    assert len(twice) == 3 * len(paths)


def test_a_csv_of_another_version_is_refused_by_name(tmp_path):
    old = tmp_path / "old.csv"
    pd.DataFrame({"method": ["em"], "K": [64], "seed": [0]}).to_csv(old, index=False)
    with pytest.raises(ValueError, match=r"old\.csv.*no column.*n_train"):
        paper_grid.read_rows(old, paper_grid.FIT_COLUMNS)


def test_the_table_gives_mean_and_sd_over_seeds_and_diverged_fits(grid):
    paths, truth = grid
    fits = paper_grid.fit_rows(paths)
    fits = fits[~((fits.method == "sgd") & (fits.K == 128) & (fits.seed == 3))]
    diverged = pd.DataFrame([["sgd", 128, 3, 2, "fit diverged at epoch 2"]], columns=paper_grid.DIVERGED_COLUMNS)
    cells = paper_grid.cell_table(fits, diverged).set_index(["method", "K"])
    for (method, K), cell in cells.iterrows():
        vals = [truth[(method, K, s)][0] for s in range(4) if (method, K, s) != ("sgd", 128, 3)]
        assert cell.val_mean == pytest.approx(np.mean(vals))
        assert cell.val_std == pytest.approx(np.std(vals, ddof=1))
        assert (cell.seeds, cell.diverged) == ((3, 1) if (method, K) == ("sgd", 128) else (4, 0))
    table = paper_grid.markdown_table(fits, diverged)
    em64 = [line for line in table.splitlines() if line.startswith("| Batch EM (Bovy et al. 2011) | 64 |")]
    vals = [truth[("em", 64, s)][0] for s in range(4)]
    assert f"{np.mean(vals):.3f} ± {np.std(vals, ddof=1):.3f}" in em64[0]
    assert "-26.10 ± 0.03" in em64[0]  # the paper's value beside it
    assert table.splitlines()[-1].endswith("| 3 | 1 |")


def test_a_cell_with_every_seed_diverged_is_still_a_row():
    fits = pd.DataFrame(columns=paper_grid.FIT_COLUMNS)
    diverged = pd.DataFrame([["sgd", 64, 0, 1, "fit diverged at epoch 1"]], columns=paper_grid.DIVERGED_COLUMNS)
    row = paper_grid.markdown_table(fits, diverged).splitlines()[-1]
    assert row.startswith("| SGD | 64 |") and row.endswith("| 0 | 1 |")


def test_paired_differences_match_scipys_paired_t_test(grid):
    paths, truth = grid
    fits = paper_grid.fit_rows(paths)
    result = paper_grid.paired(fits, "sgd", "em", 64)
    diff = np.array([truth[("sgd", 64, s)][0] - truth[("em", 64, s)][0] for s in range(4)])
    assert result["mean"] == pytest.approx(diff.mean())
    assert result["sd"] == pytest.approx(diff.std(ddof=1))
    assert result["ahead"] == 4
    t = scipy.stats.ttest_rel([truth[("sgd", 64, s)][0] for s in range(4)], [truth[("em", 64, s)][0] for s in range(4)])
    assert result["beyond_spread"] == (abs(t.statistic) > 2)  # |mean| > 2 sd / sqrt(n) is |t| > 2
    assert paper_grid.paired(fits, "sgd", "minibatch_em", 64) == {"seeds": 0}
    lines = paper_grid.orderings(fits).splitlines()
    assert any(
        line.startswith("| SGD − Batch EM (Bovy et al. 2011) | 64 | +0.21 |") and "4 of 4" in line for line in lines
    )


def test_figure_1_draws_every_seed_and_two_sd_bars(tmp_path, grid):
    paths, truth = grid
    out = tmp_path / "figure1.png"
    drawn = paper_grid.figure_1(paper_grid.fit_rows(paths), paper_grid.curve_rows(paths), 128, [out])
    assert drawn["curves"]["em"]["seeds"] == 4
    last = [truth[("sgd", 128, s)][0] - 1 / 3 for s in range(4)]  # the curve's last epoch, as _metrics draws it
    assert drawn["curves"]["sgd"]["final_mean"] == pytest.approx(np.mean(last))
    cpu = [truth[("em", 64, s)][1] for s in range(4)]
    assert drawn["timing"]["em"]["mean"][0] == pytest.approx(np.mean(cpu))
    assert drawn["timing"]["em"]["sd"][0] == pytest.approx(np.std(cpu, ddof=1))
    assert matplotlib.image.imread(out).shape[2] in (3, 4)


def _long_run():
    spec = importlib.util.spec_from_file_location("long_run", ROOT / "workflow" / "scripts" / "long_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_long_run_skips_done_and_diverged_fits_and_writes_the_page(tmp_path, grid, monkeypatch):
    long_run = _long_run()
    paths, _ = grid
    monkeypatch.setattr(long_run, "ROOT", tmp_path)
    (tmp_path / "config").mkdir()
    config = {"name": "toy", "fit": {"job_per_seed": True, "methods": ["em", "sgd"], "n_components": [64, 128]}}
    config["fit"]["seeds"] = [0, 1, 2, 3, 4]
    (tmp_path / "config" / "toy.yaml").write_text(json.dumps(config))  # JSON is YAML
    run = long_run.Grid("config/toy.yaml")
    paper_grid.merge_rows(run.fits_csv, paper_grid.fit_rows(paths), paper_grid.FIT_COLUMNS)
    paper_grid.merge_rows(run.curves_csv, paper_grid.curve_rows(paths), paper_grid.CURVE_COLUMNS)
    log = tmp_path / "results" / "toy" / "logs" / "fit" / "sgd" / "K64_seed4.log"
    log.parent.mkdir(parents=True)
    log.write_text("x INFO: epoch 1\n2026-12-07 07:48:51,808 scalable_xd ERROR: fit diverged at epoch 3, batch 7: no\n")
    diverged = run.divergence("sgd", 64, 4)
    assert diverged.to_dict("records") == [
        {"method": "sgd", "K": 64, "seed": 4, "epoch": 3, "message": "fit diverged at epoch 3, batch 7: no"}
    ]
    assert run.divergence("em", 64, 4) is None  # no log: not a divergence
    paper_grid.merge_rows(run.diverged_csv, diverged, paper_grid.DIVERGED_COLUMNS)
    assert run.missing() == [("em", 64, 4), ("em", 128, 4), ("sgd", 128, 4)]
    status = long_run.status(run)
    assert "16 of 20 fits done, 1 diverged, 3 left; not running" in status
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{long_run.TABLE_MARKS[0]}\nold\n{long_run.TABLE_MARKS[1]}\noutro\n")
    (tmp_path / "docs").mkdir(exist_ok=True)
    long_run.report(run, page)
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "| SGD | 64 |" in text and "| 4 | 1 |" in text
    assert (tmp_path / "docs" / "figure1_toy.png").exists()


def _snakemake_in(directory: Path) -> subprocess.Popen:
    """A real snakemake in ``directory`` holding its locks while its one job sleeps."""
    (directory / "Snakefile").write_text('rule slow:\n    output: "out"\n    shell: "sleep 60; touch {output}"\n')
    command = [sys.executable, "-m", "snakemake", "--cores", "1", "--quiet", "all"]
    child = subprocess.Popen(command, cwd=directory, start_new_session=True, stderr=subprocess.DEVNULL)
    locks = directory / ".snakemake" / "locks"
    for _ in range(600):
        if locks.is_dir() and any(locks.iterdir()):
            return child
        time.sleep(0.1)
    raise AssertionError("snakemake took no lock in 60 s")


def test_the_long_run_removes_a_killed_snakemakes_locks_and_no_running_ones(tmp_path, monkeypatch):
    """A session's end kills snakemake without its cleanup: the next start must not fail on the lock it left,
    and must not take the locks of a snakemake still running in the directory."""
    long_run = _long_run()
    monkeypatch.setattr(long_run, "ROOT", tmp_path)
    (tmp_path / "config").mkdir()
    config = {"name": "toy", "fit": {"job_per_seed": True, "methods": ["em"], "n_components": [64], "seeds": [0]}}
    (tmp_path / "config" / "toy.yaml").write_text(json.dumps(config))
    run = long_run.Grid("config/toy.yaml")
    run.state.mkdir(parents=True)
    locks = tmp_path / ".snakemake" / "locks"
    running = _snakemake_in(tmp_path)
    try:
        long_run.unlock_stale(run)
        assert any(locks.iterdir())
    finally:
        os.killpg(running.pid, signal.SIGKILL)
        running.wait()
    assert any(locks.iterdir())  # SIGKILL: no cleanup, the lock stays behind
    long_run.unlock_stale(run)
    assert not locks.exists() or not any(locks.iterdir())
    assert "removed the locks a killed snakemake left" in (run.state / "run.log").read_text()


def test_the_reproducing_page_shows_the_committed_grid():
    """docs/reproducing.md's ten-seed table is the one the committed CSVs give (``long_run.py report``), not
    typed: a row added to the CSVs without the report run again fails here."""
    long_run = _long_run()
    run = long_run.Grid("config/mock_cpu.yaml")
    block = f"{paper_grid.markdown_table(run.done(), run.diverged())}\n\n{paper_grid.orderings(run.done())}"
    page = (ROOT / "docs" / "reproducing.md").read_text()
    shown = page.split(long_run.TABLE_MARKS[0], 1)[1].split(long_run.TABLE_MARKS[1], 1)[0]
    assert shown.strip() == block.strip()
    assert (ROOT / "docs" / "figure1_mock_cpu.png").exists()

"""Run a grid of fits that takes days on a shared machine: in the background at the lowest CPU priority,
one fit at a time, each fit's row written to CSV files under docs/ as it ends, and resumed by the same
command after a stop, a kill or on a new machine.

    python workflow/scripts/long_run.py start  --configfile config/mock_cpu.yaml   # start, or resume
    python workflow/scripts/long_run.py status --configfile config/mock_cpu.yaml   # fits done, hours, the rest
    python workflow/scripts/long_run.py stop   --configfile config/mock_cpu.yaml   # before timing anything
    python workflow/scripts/long_run.py report --configfile config/mock_cpu.yaml   # table and figure from the CSVs

To commit progress: stop, report, commit docs/results/ with the page and the figure, start (a running fit
would add a row between the report and the commit).

Each fit is the workflow's own job (``fit.job_per_seed: true``): ``snakemake <its metrics file>`` makes what it
needs (the mock, its split, the k-means start: deterministic, so a new machine makes them again) and
resumes a stopped fit from its per-epoch checkpoint. The grid runs seed by seed, so a stopped run leaves
whole seeds. A fit whose row is in ``docs/results/<name>_fits.csv`` is done, on any machine: commit the CSVs
and a new checkout continues with the fits still missing. Its log is ``results/<name>/long_run/run.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from scalable_xd.pipeline.report import paper_grid  # noqa: E402

TABLE_MARKS = ("<!-- ten-seed-table-start -->", "<!-- ten-seed-table-end -->")
STAMPED = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")
DIVERGED = re.compile(r"ERROR: (fit diverged at epoch (\d+).*)$", re.MULTILINE)


class Grid:
    """A config's grid of fits and where its run keeps its state."""

    def __init__(self, configfile: str):
        self.configfile = configfile
        config = yaml.safe_load((ROOT / configfile).read_text())
        fit = config["fit"]
        if not fit.get("job_per_seed"):
            raise SystemExit(f"{configfile}: a long run needs fit.job_per_seed: true (one job, and one row, per fit)")
        self.name = config["name"]
        self.methods, self.ks, self.seeds = fit["methods"], fit["n_components"], fit["seeds"]
        self.figure_k = config.get("report", {}).get("figure_K", 256)
        self.state = ROOT / "results" / self.name / "long_run"
        self.fits_csv = ROOT / "docs" / "results" / f"{self.name}_fits.csv"
        self.curves_csv = ROOT / "docs" / "results" / f"{self.name}_curves.csv"
        self.diverged_csv = ROOT / "docs" / "results" / f"{self.name}_diverged.csv"

    def fits(self) -> list[tuple[str, int, int]]:
        """Every (method, K, seed), seed by seed, then by K and method."""
        return [(method, K, seed) for seed in self.seeds for K in self.ks for method in self.methods]

    def done(self) -> pd.DataFrame:
        return paper_grid.read_rows(self.fits_csv, paper_grid.FIT_COLUMNS)

    def diverged(self) -> pd.DataFrame:
        return paper_grid.read_rows(self.diverged_csv, paper_grid.DIVERGED_COLUMNS)

    def missing(self) -> list[tuple[str, int, int]]:
        """The fits with no row yet, either finished or diverged."""
        ended = pd.concat([self.done()[paper_grid.KEY], self.diverged()[paper_grid.KEY]])
        done = set(map(tuple, ended.to_numpy().tolist()))
        return [fit for fit in self.fits() if fit not in done]

    def metrics(self, method: str, K: int, seed: int) -> Path:
        return ROOT / "results" / self.name / "fits" / method / f"K{K}_seed{seed}" / "metrics.json"

    def divergence(self, method: str, K: int, seed: int) -> pd.DataFrame | None:
        """The fit's ``DIVERGED_COLUMNS`` row where its log ends in a divergence (``FitDivergedError``), else
        None (any other failure: the run stops for someone to look)."""
        log_file = ROOT / "results" / self.name / "logs" / "fit" / method / f"K{K}_seed{seed}.log"
        found = DIVERGED.findall(log_file.read_text()) if log_file.exists() else []
        if not found:
            return None
        message, epoch = found[-1]
        return pd.DataFrame([[method, K, seed, int(epoch), message]], columns=paper_grid.DIVERGED_COLUMNS)

    def pid(self) -> int | None:
        """The running driver's process group, or None."""
        try:
            pid = int((self.state / "pid").read_text())
            os.killpg(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
            return None
        return pid


def log(grid: Grid, message: str) -> None:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    with open(grid.state / "run.log", "a") as out:
        out.write(f"{stamp} {message}\n")


def start(grid: Grid, cores: str) -> None:
    """The run in the background, in a session of its own at nice 19; nothing where one already runs."""
    running = grid.pid()
    if running:
        print(f"already running (process group {running}); `status` tells its progress")
        return
    grid.state.mkdir(parents=True, exist_ok=True)
    unlock_stale(grid)
    command = [sys.executable, __file__, "run", "--configfile", grid.configfile, "--cores", cores]
    with open(grid.state / "run.log", "a") as out:
        child = subprocess.Popen(
            ["nice", "-n", "19", *command], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    (grid.state / "pid").write_text(str(child.pid))
    print(f"started: {len(grid.missing())} of {len(grid.fits())} fits to go; log {grid.state / 'run.log'}")


def unlock_stale(grid: Grid) -> None:
    """Remove the locks a killed snakemake left (a session's end kills it without its cleanup), so the next fit
    does not fail on them; nothing while a snakemake still runs in this directory, whose locks they may be."""
    locks = ROOT / ".snakemake" / "locks"
    if not locks.is_dir() or not any(locks.iterdir()):
        return
    for process in psutil.process_iter(["cmdline", "cwd"]):
        with contextlib.suppress(psutil.Error):
            if process.info["cwd"] == str(ROOT) and any("snakemake" in part for part in process.info["cmdline"] or []):
                return
    command = [sys.executable, "-m", "snakemake", "--unlock", "--configfile", grid.configfile, "--quiet", "all"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    log(grid, "removed the locks a killed snakemake left")


def run(grid: Grid, cores: str) -> None:
    """Each missing fit by ``snakemake <its metrics file>``, its rows written to the CSVs as it ends."""
    # the rules' `python` is this one, with its packages, even where its environment is not activated
    environment = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    for method, K, seed in grid.missing():
        target = grid.metrics(method, K, seed).relative_to(ROOT)
        log(grid, f"fit {method} K={K} seed={seed}")
        command = ["snakemake", str(target), "--cores", cores, "--configfile", grid.configfile]
        # a fit's inputs made again on a new machine are newer than nothing it has; code edits rerun nothing
        command += ["--rerun-triggers", "mtime", "--rerun-incomplete", "--quiet", "rules"]
        finished = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, env=environment)
        diverged = grid.divergence(method, K, seed) if finished.returncode else None
        if diverged is not None:
            paper_grid.merge_rows(grid.diverged_csv, diverged, paper_grid.DIVERGED_COLUMNS)
            log(grid, f"diverged {method} K={K} seed={seed}: {diverged.message.iloc[0]}")
            continue
        if finished.returncode:
            log(
                grid,
                f"snakemake failed ({finished.returncode}) on {target}: see its log under results/{grid.name}/logs",
            )
            raise SystemExit(finished.returncode)
        paths = [grid.metrics(method, K, seed)]
        paper_grid.merge_rows(grid.fits_csv, paper_grid.fit_rows(paths), paper_grid.FIT_COLUMNS)
        paper_grid.merge_rows(grid.curves_csv, paper_grid.curve_rows(paths), paper_grid.CURVE_COLUMNS)
        log(grid, f"done {method} K={K} seed={seed}")
    log(grid, "the grid is complete")


def stop(grid: Grid) -> None:
    """The run and its fits stopped (each resumes from its last checkpoint at the next start)."""
    pid = grid.pid()
    if pid is None:
        print("not running")
        return
    os.killpg(pid, signal.SIGTERM)
    for _ in range(60):
        if grid.pid() is None:
            break
        time.sleep(1)
    else:
        os.killpg(pid, signal.SIGKILL)
    log(grid, "stopped")
    print(f"stopped process group {pid}")


def status(grid: Grid) -> str:
    """Fits done and left, the CPU hours they took, and an estimate of the rest: each missing fit at the
    mean CPU seconds of its (method, K) over the seeds done, or, for a cell not yet run, at the nearest K's
    scaled in proportion to K."""
    done, missing, diverged = grid.done(), grid.missing(), grid.diverged()
    cpu = done.groupby(["method", "K"]).train_cpu_seconds.mean()
    wall = done.groupby(["method", "K"]).wall_seconds.mean()

    def estimate(table: pd.Series, method: str, K: int) -> float:
        if (method, K) in table:
            return float(table[(method, K)])
        known = [k for (m, k) in table.index if m == method]
        if not known:
            return float("nan")
        nearest = min(known, key=lambda k: abs(k - K))
        return float(table[(method, nearest)]) * K / nearest

    rest_cpu = np.nansum([estimate(cpu, m, k) for m, k, _ in missing])
    rest_wall = np.nansum([estimate(wall, m, k) for m, k, _ in missing])
    unknown = sorted({m for m, k, _ in missing if np.isnan(estimate(cpu, m, k))})
    running = grid.pid()
    lines = [
        f"{grid.name}: {len(done)} of {len(grid.fits())} fits done, {len(diverged)} diverged, {len(missing)} left; "
        + (f"running (process group {running})" if running else "not running"),
        f"done: {done.train_cpu_seconds.sum() / 3600:.2f} CPU hours of training, "
        f"{done.wall_seconds.sum() / 3600:.2f} hours of fits' wall time",
        f"left, at the seeds done's pace: {rest_cpu / 3600:.1f} CPU hours of training, "
        f"about {rest_wall / 3600:.1f} hours of wall time (each fit's loading and scoring included)"
        + (f"; not counted: {', '.join(unknown)}, with no fit done yet" if unknown else ""),
    ]
    if missing:
        lines.append(f"next: {missing[0][0]} K={missing[0][1]} seed={missing[0][2]}")
    log_file = grid.state / "run.log"
    own = [line for line in log_file.read_text().splitlines() if STAMPED.match(line)] if log_file.exists() else []
    if own:  # the driver's own lines, not the snakemake output between them
        lines.append("last event: " + own[-1])
    return "\n".join(lines)


def report(grid: Grid, page: Path) -> None:
    """The table, the orderings and Figure 1 from the CSVs: the table between ``TABLE_MARKS`` in ``page``,
    the figure as docs/figure1_<name>.png."""
    fits = grid.done()
    curves = paper_grid.read_rows(grid.curves_csv, paper_grid.CURVE_COLUMNS)
    if fits.empty:
        raise SystemExit(f"{grid.fits_csv}: no fits yet")
    block = f"{paper_grid.markdown_table(fits, grid.diverged())}\n\n{paper_grid.orderings(fits)}"
    text = page.read_text()
    head, rest = text.split(TABLE_MARKS[0], 1)
    _, tail = rest.split(TABLE_MARKS[1], 1)
    page.write_text(f"{head}{TABLE_MARKS[0]}\n{block}\n{TABLE_MARKS[1]}{tail}")
    figure = ROOT / "docs" / f"figure1_{grid.name}.png"
    paper_grid.figure_1(fits, curves, grid.figure_k, [figure])
    print(f"wrote the table into {page} and {figure}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "action", choices=["start", "status", "stop", "report", "run"], help="run: the loop `start` runs"
    )
    parser.add_argument("--configfile", default="config/mock_cpu.yaml", help="a config with fit.job_per_seed: true")
    parser.add_argument("--cores", default="all", help="snakemake's --cores for each fit (default: all)")
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "reproducing.md", help="where `report` writes")
    args = parser.parse_args(argv)
    grid = Grid(args.configfile)
    if args.action == "start":
        start(grid, args.cores)
    elif args.action == "run":
        run(grid, args.cores)
    elif args.action == "stop":
        stop(grid)
    elif args.action == "status":
        print(status(grid))
    else:
        report(grid, args.page)


if __name__ == "__main__":
    main()

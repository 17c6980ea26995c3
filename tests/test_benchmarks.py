"""Every benchmark runs: each in its quick mode (tiny sizes, seconds), its JSON written to a temporary
folder, so that a change that breaks one fails here instead of when someone next measures. The numbers
themselves live in benchmarks/results/, measured on a quiet machine; none is asserted here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_") and p.stem != "summarise_run")

pytestmark = pytest.mark.slow


def run_quick(script: str, tmp_path: Path, *args: str) -> list[dict]:
    """``script --quick`` in a fresh process; the JSON files it wrote."""
    env = {**os.environ, "BENCH_QUICK_RESULTS": str(tmp_path)}
    command = [sys.executable, str(BENCHMARKS / f"{script}.py"), "--quick", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"{script} --quick failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_benchmark_runs_in_its_quick_mode(script, tmp_path):
    written = run_quick(script, tmp_path)
    assert len(written) >= 1 and all(written), script
    assert not any(tmp_path.glob("*.tmp"))

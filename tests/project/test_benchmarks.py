"""Every benchmark runs: each in its quick mode (tiny sizes, seconds), its JSON written to a temporary
folder, so that a change that breaks one fails here instead of when someone next measures. The numbers
themselves live in benchmarks/results/, measured on a quiet machine; none is asserted here."""

import json
from pathlib import Path

import pytest
from helpers import SHARED_SAMPLE, run_quick

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_") and p.stem != "summarise_run")

pytestmark = pytest.mark.slow


# What a benchmark reads beside the checkout: without it, its quick mode is skipped (the shared real DR2 rows).
NEEDS = {"bench_real_peer": SHARED_SAMPLE / "gdr2_sm.fits"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_benchmark_runs_in_its_quick_mode(script, tmp_path):
    if script in NEEDS and not NEEDS[script].exists():
        pytest.skip(f"{NEEDS[script]} is not beside the checkout")
    written = run_quick(script, tmp_path)
    assert len(written) >= 1 and all(written), script
    assert not any(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("step", ["graphed", "evaluation"])
def test_profile_batch_profiles_each_kind_of_step(step, tmp_path):
    """profile_batch's other steps (the graphed step's body, a validation scoring) run too."""
    (written,) = run_quick("profile_batch", tmp_path, "--step", step)
    assert written["step"] == step and written["seconds_per_update"] > 0


def test_bench_fit_times_the_pass_by_chunk_size_with_its_checks_deferred(tmp_path):
    """The GPU session's ``chunks`` step: one row a chunk size, the checks named, no baselines timed."""
    (written,) = run_quick(
        "bench_fit", tmp_path, "--max-pairs", "2000", "100000", "--deferred-checks", "--skip-baselines", "--skip-epochs"
    )
    rows = written["results"]
    assert [row["max_pairs"] for row in rows] == [2000, 100000]
    assert all(row["checks"] == "deferred" and row["fused_pairs_per_s"] > 0 for row in rows)
    assert not any("linalg_pairs_per_s" in row or "reference_pairs_per_s" in row for row in rows)


def test_bench_defaults_takes_an_earlier_run_s_optima_when_given(tmp_path):
    """``--optima``: each (shape, N) found in an earlier JSON takes its optimum and single Gaussian from
    there (here moved by a nat, so that a value fitted again could not match), and the shares follow."""
    (first,) = run_quick("bench_defaults", tmp_path / "first")
    for row in first["results"]:
        row["optimum"] += 1.0
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(first))
    (second,) = run_quick("bench_defaults", tmp_path / "second", "--optima", str(earlier))
    for mine, theirs in zip(second["results"], first["results"], strict=True):
        assert (mine["optimum"], mine["single_gaussian"]) == (theirs["optimum"], theirs["single_gaussian"])
        share = (mine["em"]["loglik"] - mine["single_gaussian"]) / (mine["optimum"] - mine["single_gaussian"])
        assert mine["em"]["share"] == pytest.approx(share, rel=1e-12)

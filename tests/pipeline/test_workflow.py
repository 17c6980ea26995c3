"""The real snakemake on config/smoke.yaml in a temporary directory, and the paper config's plan."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SMOKE = yaml.safe_load((REPO / "config" / "smoke.yaml").read_text())
METHODS, KS, SEEDS = SMOKE["fit"]["methods"], SMOKE["fit"]["n_components"], SMOKE["fit"]["seeds"]
FIGURE_K = SMOKE["report"]["figure_K"]

pytestmark = pytest.mark.slow


def snakemake(workdir: Path, *args: str, configfile: str = "smoke.yaml", timeout: int = 600):
    """Run snakemake as from an activated environment: this interpreter's directory first on PATH."""
    command = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--configfile",
        str(REPO / "config" / configfile),
    ]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(command + list(args), capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, (
        f"snakemake {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout + result.stderr


def planned_jobs(output: str) -> dict[str, int]:
    """The 'Job stats' table of a dry run, as {rule: count}."""
    stats = output.split("Job stats:")[1].split("\n\n")[0]
    rows = re.findall(r"^(\w+)\s+(\d+)$", stats, flags=re.M)
    return {rule: int(count) for rule, count in rows if rule != "total"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("smoke")
    snakemake(workdir, "--cores", "2")
    return workdir / "results" / "smoke"


def test_table_has_one_finite_row_per_method_and_k(smoke):
    table = pd.read_csv(smoke / "tables" / "loglik.csv")
    assert sorted(zip(table.method, table.K)) == sorted((m, k) for m in METHODS for k in KS)
    assert table[["val_mean", "val_std", "val_observed_mean", "train_seconds_mean"]].notna().all().all()
    assert (table.n_seeds == len(SEEDS)).all()
    best = table[table.best_K]
    assert sorted(best.method) == sorted(METHODS) and best.test_mean.notna().all()
    assert table[~table.best_K].test_mean.isna().all()
    md, tex = (smoke / "tables" / "loglik.md").read_text(), (smoke / "tables" / "loglik.tex").read_text()
    assert md.startswith("Mean log-likelihood per star in nats") and md.count("\n") == 4 + len(METHODS) * len(KS)
    assert tex.startswith(r"\begin{tabular}") and tex.rstrip().endswith(r"\end{tabular}")


def test_a_run_is_summarised_by_its_benchmark_script(smoke, tmp_path):
    from helpers import run_quick

    (summary,) = run_quick("summarise_run", tmp_path, str(smoke))
    assert summary["run"] == "smoke" and {row["method"] for row in summary["rows"]} == set(METHODS)


def test_figures_are_images_of_the_expected_size(smoke):
    from PIL import Image

    from scalable_xd.pipeline.report.style import COLUMN, COLUMN_HEIGHT, DPI, LEGEND_ROW, PAGE

    column, page = (round(COLUMN * DPI), round(COLUMN_HEIGHT * DPI)), (round(PAGE * DPI), round(PAGE * DPI))
    expected = {"timing_vs_K": column, f"training_curves_K{FIGURE_K}": column, "sky_density": None}
    expected.update({f"corner_{m}_K{FIGURE_K}": page for m in METHODS})
    for name, size in expected.items():
        with Image.open(smoke / "figures" / f"{name}.png") as image:
            if size == column:  # a column wide, and taller by whole legend rows where the legend needs them
                extra_rows = (image.size[1] - column[1]) / (LEGEND_ROW * DPI)
                assert image.size[0] == column[0] and extra_rows >= 0, name
                assert abs(extra_rows - round(extra_rows)) < 0.05, name
            else:
                assert size is None or image.size == size, name
                assert image.size[0] == round(PAGE * DPI), name
            assert len(np.unique(np.asarray(image.convert("L")))) > 50, f"{name} looks blank"
        assert (smoke / "figures" / f"{name}.pdf").read_bytes().startswith(b"%PDF"), name


def test_the_denoised_catalogue_and_its_calibration(smoke):
    """Every test star gets its posterior; the calibration's parallax figures are recomputed here from the
    catalogue's columns and the features file's true values, independently of the pipeline's code."""
    from scalable_xd.pipeline.features_file import read_features

    denoised = pd.read_parquet(smoke / "denoised" / "test.parquet")
    test = read_features(smoke / "data" / "test.parquet")
    assert (denoised.source_id.to_numpy() == test.source_id).all()
    truth = test.true[:, test.spec.names.index("parallax")]
    calibration = json.loads((smoke / "tables" / "calibration.json").read_text())
    parallax = calibration["features"]["parallax"]
    inside = (truth >= denoised.q16_parallax) & (truth <= denoised.q84_parallax)
    assert parallax["coverage_68"] == pytest.approx(inside.mean())
    measured = test.sigma[:, test.spec.names.index("parallax")] < 1e5
    rmse = lambda d: np.sqrt(np.mean(np.square(d)))  # noqa: E731
    ratio = rmse(denoised.mean_parallax[measured] - truth[measured]) / rmse(test.X[measured, 2] - truth[measured])
    assert parallax["rmse_ratio"] == pytest.approx(ratio)
    assert 0.5 < parallax["pull_sd"] < 1.5 and parallax["rmse_ratio"] < 1  # the posterior sharpens parallaxes
    assert (denoised.q025_parallax <= denoised.q50_parallax).all() and (
        denoised.q50_parallax <= denoised.q975_parallax
    ).all()
    assert (smoke / "tables" / "calibration.md").read_text().startswith("Posterior calibration on")
    from PIL import Image

    with Image.open(smoke / "figures" / "denoised.png") as image:
        assert len(np.unique(np.asarray(image.convert("L")))) > 50


def test_the_parameter_errors_of_the_smallest_k(smoke):
    """The DAG's jackknife output: every component of the grid's smallest K with finite, positive standard
    errors, heaviest first, the centre a refit of batch EM's model of that K (the smoke run has em)."""
    k = min(KS)
    result = json.loads((smoke / "tables" / f"parameter_errors_K{k}.json").read_text())
    assert result["model"].endswith(f"fits/em/K{k}_seed{SMOKE['report']['seed']}/model.npz")
    assert len(result["components"]) == k and result["n_folds"] == 10
    weights = [c["weight"] for c in result["components"]]
    assert weights == sorted(weights, reverse=True) and sum(weights) == pytest.approx(1.0)
    for c in result["components"]:
        assert c["weight_se"] > 0 and np.all(np.isfinite(c["mean_se"])) and np.all(np.asarray(c["mean_se"]) > 0)
        assert np.all(np.isfinite(c["covariance_se"]))
    table = (smoke / "tables" / f"parameter_errors_K{k}.md").read_text()
    assert table.startswith("Jackknife standard errors (10 groups") and table.count("±") > k


def test_metrics_are_complete(smoke):
    for method in METHODS:
        for k in KS:
            for seed in SEEDS:
                m = json.loads((smoke / "fits" / method / f"K{k}_seed{seed}" / "metrics.json").read_text())
                assert (m["method"], m["n_components"], m["seed"], m["tag"]) == (method, k, seed, "smoke")
                for split in ("train", "val", "test"):
                    assert math.isfinite(m[split]["loglik"]) and math.isfinite(m[split]["loglik_observed"])
                    assert m[split]["loglik_observed"] > m[split]["loglik"]  # missing entries removed
                assert len(m["history"]) == SMOKE["fit"]["epochs"] + 1
                assert m["train_seconds"] > 0 and m["device"] == "cpu" and len(m["config_hash"]) == 12
                assert set(m["versions"]) == {"scalable_xd", "torch", "numpy", "python"}
                assert not (smoke / "fits" / method / f"K{k}_seed{seed}" / "checkpoint.pt").exists()


def test_fits_are_scored_against_the_mocks_truth(smoke):
    """Every fit's true-value log-likelihood, recomputed from its saved model and the test stars' true
    values, at the end and in its history; the gap closed from the reference files; the table's truth
    columns; claims.md."""
    from scalable_xd import XDGMM
    from scalable_xd.pipeline.features_file import read_features

    true = read_features(smoke / "data" / "test.parquet").true
    fit = smoke / "fits" / "em" / f"K{FIGURE_K}_seed{SEEDS[0]}"
    metrics = json.loads((fit / "metrics.json").read_text())["true"]
    model = XDGMM.load(fit / "model.npz")
    per_star = model.score_samples(true, Xcov=np.zeros_like(true)).astype(np.float64)
    assert metrics["test_true_loglik"] == pytest.approx(per_star.mean(), rel=1e-5)
    refs = {
        kind: json.loads((smoke / "references" / kind / f"K{FIGURE_K}_seed{SEEDS[0]}.json").read_text())
        for kind in ("oracle", "noisy", "achievable")
    }
    oracle, noisy = refs["oracle"]["test_true_loglik"], refs["noisy"]["test_true_loglik"]
    achievable = refs["achievable"]["test_true_loglik"]
    assert oracle > achievable > noisy  # the truth beats converged XD, which beats ignoring the noise
    assert refs["achievable"]["converged"] and refs["achievable"]["settings"]["acceleration"] == "squarem"
    assert metrics["true_gap_closed"] == pytest.approx((per_star.mean() - noisy) / (oracle - noisy), rel=1e-4)
    share = (per_star.mean() - noisy) / (achievable - noisy)
    assert metrics["true_share_of_achievable"] == pytest.approx(share, rel=1e-4)
    table = pd.read_csv(smoke / "tables" / "loglik.csv")
    assert table[["true_test_mean", "gap_closed_mean", "share_of_achievable_mean"]].notna().all().all()
    claims = (smoke / "claims.md").read_text()
    assert len(re.findall(r"^\d+\. .*: \*\*(holds|does not hold|not measured)\*\*", claims, flags=re.M)) == 11
    # followed epoch by epoch: the last entry scored the saved model; the time to 90% read off the curve
    history = json.loads((fit / "metrics.json").read_text())["history"]
    assert history[-1]["true_loglik"] == pytest.approx(per_star.mean(), rel=1e-5)
    reached = [e["seconds"] for e in history if (e["true_loglik"] - noisy) / (achievable - noisy) >= 0.9]
    assert metrics["seconds_to_share"]["0.9"] == (reached[0] if reached else None)


def test_metrics_agree_with_the_saved_model(smoke):
    """The reported log-likelihoods, recomputed star by star from the saved model and the data split."""
    from scalable_xd import XDGMM
    from scalable_xd.pipeline.features_file import read_features

    fit = smoke / "fits" / "minibatch_em" / f"K{FIGURE_K}_seed{SEEDS[0]}"
    metrics = json.loads((fit / "metrics.json").read_text())
    model = XDGMM.load(fit / "model.npz")
    for split in ("val", "test"):
        data = read_features(smoke / "data" / f"{split}.parquet")
        per_star = model.score_samples(data.X, Xcov=data.covariance()).astype(np.float64)
        observed = per_star + data.n_missing * 0.5 * math.log(2 * math.pi * 1e12)
        assert metrics[split]["loglik"] == pytest.approx(per_star.mean(), rel=1e-5)
        assert metrics[split]["loglik_observed"] == pytest.approx(observed.mean(), rel=1e-5)


def test_second_run_is_a_no_op(smoke):
    assert "Nothing to be done" in snakemake(smoke.parents[1], "--dry-run", "--cores", "2")


def test_deleting_one_fit_reruns_only_its_method_and_k_and_their_dependents(smoke):
    """A fit job fits every seed of one method and K (the data read once): deleting one seed's metrics
    reruns that job, whose other seeds are fitted again to the same numbers, and no other fit."""
    victim = smoke / "fits" / "sgd" / f"K{KS[0]}_seed{SEEDS[-1]}"
    sibling = smoke / "fits" / "sgd" / f"K{KS[0]}_seed{SEEDS[0]}" / "metrics.json"
    untouched = smoke / "fits" / "em" / f"K{KS[0]}_seed{SEEDS[-1]}" / "metrics.json"
    before, sibling_before = untouched.stat().st_mtime_ns, json.loads(sibling.read_text())
    (victim / "metrics.json").unlink()
    plan = planned_jobs(snakemake(smoke.parents[1], "--dry-run", "--cores", "2"))
    assert plan == {"fit": 1, "loglik_table": 1, "claims": 1, "timing_vs_k": 1, "all": 1}
    snakemake(smoke.parents[1], "--cores", "2")
    assert (victim / "metrics.json").exists() and untouched.stat().st_mtime_ns == before
    sibling_after = json.loads(sibling.read_text())
    assert sibling_after["history"][-1]["train_loglik"] == sibling_before["history"][-1]["train_loglik"]


def test_html_report_captions_every_output(smoke, tmp_path):
    report = tmp_path / "report.html"
    snakemake(smoke.parents[1], "--report", str(report))
    html = report.read_text(errors="replace")
    for caption in (
        "Table 1 of the paper",
        "Figure 1 (right)",
        "Figure 1 (left)",
        "Figure 2 of the paper",
        "Corner plot",
    ):
        assert caption in html
    assert "System Message" not in html and "Undefined substitution" not in html  # docutils rendered every caption


def test_lint_is_clean(tmp_path):
    assert "Congratulations, your workflow is in a good condition" in snakemake(tmp_path, "--lint")


def test_paper_config_plans_the_full_grid_without_the_network(tmp_path):
    output = snakemake(tmp_path, "--dry-run", "--printshellcmds", "--cores", "4", configfile="config.yaml")
    plan = planned_jobs(output)
    assert plan["fit"] == 3 * 4 and plan["kmeans"] == 4 * 10  # a fit job fits every seed of a method and K
    assert output.count(" --backend auto ") == plan["fit"]  # numba on the CPU, triton on CUDA
    assert plan["query_gaia"] == 1 and "mock_catalogue" not in plan
    assert "reference" not in plan and plan["claims"] == 1  # Gaia data have no truth to score against
    assert not (tmp_path / "resources").exists()  # a dry run downloads nothing


def test_the_cpu_sized_mock_config_plans_the_paper_grid_one_job_per_fit_and_no_references(tmp_path):
    output = snakemake(tmp_path, "--dry-run", "--printshellcmds", "--cores", "4", configfile="mock_cpu.yaml")
    plan = planned_jobs(output)
    assert plan["fit"] == 3 * 4 * 10 and plan["kmeans"] == 4 * 10 and plan["mock_catalogue"] == 1
    assert "reference" not in plan  # truth.references: false
    commands = [line for line in output.splitlines() if " fit --train " in line]
    assert len(commands) == 120 and not any("--reference" in c for c in commands)
    # fit.job_per_seed: each job one seed, its own init, outputs and log
    fitted = [(re.search(r"--label (\w+) ", c)[1], re.search(r"--seed (\d+) ", c)[1], c) for c in commands]
    assert {(method, seed) for method, seed, _ in fitted} == {
        (m, str(s)) for m in ("em", "minibatch_em", "sgd") for s in range(10)
    }
    for method, seed, command in fitted:
        assert command.count("--init ") == 1 and f"_seed{seed}.npz --n-components" in command
        assert re.search(rf"--output-model \S+/{method}/K\d+_seed{seed}/model.npz --output-metrics", command)
        assert re.search(rf"logs/fit/{method}/K\d+_seed{seed}.log", command)
    assert "resources/mock/mock_n2000000_seed0.parquet" in output  # the paper's 2,000,000 rows


def test_the_demos_jobs_are_the_ones_reproducing_md_states(tmp_path):
    """docs/reproducing.md's counts of the demo's fit and reference jobs, against its dry run's plan."""
    import yaml

    plan = planned_jobs(snakemake(tmp_path, "--dry-run", "--cores", "4", configfile="demo.yaml"))
    seeds = len(yaml.safe_load((REPO / "config" / "demo.yaml").read_text())["fit"]["seeds"])
    text = " ".join((REPO / "docs" / "reproducing.md").read_text().split())
    stated = re.search(r"it runs (\d+) fit jobs \((\d+) fits: three seeds each\) and (\d+) reference fits", text)
    assert stated is not None and seeds == 3
    assert [int(n) for n in stated.groups()] == [plan["fit"], plan["fit"] * seeds, plan["reference"]]


def test_the_methods_config_plans_every_method_and_variant_with_its_settings(tmp_path):
    output = snakemake(tmp_path, "--dry-run", "--printshellcmds", "--cores", "4", configfile="methods.yaml")
    commands = [line for line in output.splitlines() if " fit --train " in line]
    assert len(commands) == 6  # one job per method or variant (one K), fitting its 3 seeds
    for method in ("em", "minibatch_em", "sgd", "stochastic_em", "stochastic_minibatch_em"):
        own = [c for c in commands if f"/fits/{method}/" in c]
        assert len(own) == 1 and all(f" --method {method} " in c and "--averaging none" in c for c in own), method
        assert all(c.count(f"/fits/{method}/") == 2 * 3 + 3 for c in own)  # each seed's model, metrics, checkpoint
    polyak = [c for c in commands if "/fits/minibatch_em_polyak/" in c]
    assert len(polyak) == 1 and all(" --method minibatch_em " in c and "--averaging polyak" in c for c in polyak)
    assert all("--label minibatch_em_polyak" in c for c in polyak)  # reported under the variant's name


def test_fit_processes_runs_each_fit_under_torchrun(tmp_path):
    config = {
        **SMOKE,
        "fit": {
            **SMOKE["fit"],
            "processes": 2,
            "threads": 4,
            "device": "cuda",
            "stream_window": 4096,
            "checkpoint_every": 1000,
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    output = snakemake(
        tmp_path / "run", "--dry-run", "--printshellcmds", "--cores", "4", configfile=str(tmp_path / "config.yaml")
    )
    commands = [line for line in output.splitlines() if " fit --train " in line]
    assert len(commands) == len(METHODS) * len(KS)  # each fitting every seed
    for command in commands:
        assert "python -m torch.distributed.run --standalone --nproc-per-node 2 -m scalable_xd" in command
        assert "--threads 2 " in command  # the fit's threads shared among its processes
        window = "4096" if "--selection none" in command else "0"  # under a selection: its splits cut in memory
        assert f"--stream-window {window} " in command and "--checkpoint-every 1000 " in command
    kmeans = [line for line in output.splitlines() if " kmeans --train " in line]
    assert kmeans and not any("torch.distributed" in line for line in kmeans)
    jobs = re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", output, flags=re.M)
    fits = [r.split(", ") for rule, r in jobs if rule == "fit"]
    assert len(fits) == len(commands) and all("gpu=2" in r for r in fits)  # one GPU per process
    assert all("gpu=1" in r.split(", ") for rule, r in jobs if rule == "kmeans")


def test_each_config_mistake_is_one_line_naming_its_key(tmp_path):
    """Snakemake's validation message gives the first mistake, followed by hundreds of lines of schema;
    ours names every mistake's key, one line each."""
    config = {
        **SMOKE,
        "data": {**{k: v for k, v in SMOKE["data"].items() if k != "n_rows"}, "n_row": 10},
        "fit": {**SMOKE["fit"], "batch_size": 0},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path)]
    result = subprocess.run(
        command + ["--configfile", str(tmp_path / "config.yaml"), "--dry-run"], capture_output=True, text=True
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "the config's data: Additional properties are not allowed ('n_row' was unexpected)" in output
    assert "the config's fit.batch_size: 0 is less than the minimum of 1" in output
    assert len(output.splitlines()) < 15, output


def test_fit_nodes_start_one_torchrun_per_node_under_srun(tmp_path):
    config = {**SMOKE, "fit": {**SMOKE["fit"], "processes": 4, "nodes": 2, "device": "cuda"}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    output = snakemake(tmp_path / "run", "--dry-run", "--printshellcmds", configfile=str(tmp_path / "config.yaml"))
    commands = [line for line in output.splitlines() if " fit --train " in line]
    assert commands and all(
        "srun --nodes 2 --ntasks-per-node 1 python -m torch.distributed.run --nnodes 2 --nproc-per-node 4 "
        "--rdzv-backend c10d --rdzv-id $SLURM_JOB_ID" in c
        for c in commands
    )
    jobs = re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", output, flags=re.M)
    assert all("nodes=2" in r.split(", ") and "gpu=4" in r.split(", ") for rule, r in jobs if rule == "fit")


def test_an_unknown_method_in_the_grid_is_named(tmp_path):
    config = {**SMOKE, "fit": {**SMOKE["fit"], "methods": ["em", "minibatch_em_polyak"]}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    command = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(tmp_path),
        "--configfile",
        str(tmp_path / "config.yaml"),
        "--dry-run",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert (
        "fit.methods ['minibatch_em_polyak'] are neither methods nor names of fit.variants"
        in result.stdout + result.stderr
    )


def test_the_report_command_works_as_documented_without_cores(smoke, tmp_path):
    """`snakemake --report report.html --configfile ...` with fit.threads 0 (every config but smoke): the
    rules' thread count once asked snakemake for --cores, which a report does not give."""
    config = {**SMOKE, "fit": {**SMOKE["fit"], "threads": 0}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    report = tmp_path / "report.html"
    snakemake(smoke.parents[1], "--report", str(report), configfile=str(tmp_path / "config.yaml"))
    assert "Table 1 of the paper" in report.read_text(errors="replace")


def test_slurm_profile_asks_one_gpu_per_fit(tmp_path):
    """The SLURM profile's resources, seen in a dry run (executor and conda dropped: neither the plugin nor
    conda is needed to plan): one GPU in the gpu partition for every fit and k-means job."""
    profile = yaml.safe_load((REPO / "workflow" / "profiles" / "slurm" / "config.yaml").read_text())
    assert profile["executor"] == "slurm"
    profile = {k: v for k, v in profile.items() if k not in ("executor", "use-conda")}
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "config.yaml").write_text(yaml.safe_dump(profile))
    output = snakemake(tmp_path / "run", "--dry-run", "--profile", str(tmp_path / "profile"), "--cores", "4")
    jobs = re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", output, flags=re.M)
    resources = {rule: [r for name, r in jobs if name == rule] for rule in ("fit", "kmeans")}
    assert len(resources["fit"]) == len(METHODS) * len(KS) and len(resources["kmeans"]) == len(KS) * len(SEEDS)
    for rule, lines in resources.items():
        for line in lines:
            assert "gpu=1" in line.split(", ") and "slurm_partition=gpu" in line.split(", "), (rule, line)

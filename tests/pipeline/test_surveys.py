"""A survey is one module and its config (``pipeline.surveys``): a made-up survey defined in the tests alone
(``surveys/toy_survey.py``) goes through the real ``snakemake``'s default target from its raw file to every
table and every figure its features' roles allow, labelled as it labels them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from scalable_xd.pipeline.features_file import read_features
from scalable_xd.pipeline.report.figures import plot_corner
from scalable_xd.pipeline.surveys import survey_module

REPO = Path(__file__).parents[2]
SURVEYS = Path(__file__).parent / "surveys"

pytestmark = pytest.mark.slow


def _raw_catalogue(path: Path, n: int = 1200) -> None:
    rng = np.random.default_rng(0)
    centres = np.array([[0.5, 15.0, 300.0], [1.5, 18.0, 900.0]])
    true = centres[rng.integers(0, 2, n)] + rng.normal(size=(n, 3)) * [0.1, 0.5, 50.0]
    errors = rng.uniform(0.05, 0.2, (n, 3)) * [1.0, 1.0, 100.0]
    frame = pd.DataFrame(true + errors * rng.normal(size=(n, 3)), columns=["colour", "magnitude", "distance"])
    frame[["colour_error", "magnitude_error", "distance_error"]] = errors
    frame["c_d_corr"], frame["id"] = rng.uniform(-0.3, 0.3, n), np.arange(n)
    frame.to_csv(path, index=False)


def test_a_new_survey_is_its_module_and_its_config(tmp_path):
    raw = tmp_path / "toy.csv"
    _raw_catalogue(raw)
    config = {
        "name": "toy",
        "data": {
            "source": "file",
            "raw": str(raw),
            "survey": "toy_survey",
            "covariance_mode": "corrected",
            "split_seed": 0,
        },
        "init": {"kmeans_epochs": 2, "kmeans_batch_size": 200},
        "fit": {"methods": ["em", "minibatch_em"], "n_components": [2], "seeds": [0], "epochs": 3, "device": "cpu"},
        "report": {"figure_K": 2, "sky_method": "em", "samples": 1000, "seed": 0},
    }
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(config))
    paths = [str(SURVEYS), os.environ.get("PYTHONPATH", "")]  # the survey's module, as a user's installed one
    # run as from an activated environment: this interpreter's directory first on PATH
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    command = [sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", str(tmp_path / "toy.yaml")]
    command += ["--directory", str(tmp_path), "--snakefile", str(REPO / "Snakefile")]  # the default target
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = tmp_path / "results" / "toy"
    train = read_features(results / "data" / "train.parquet")
    assert train.spec.survey == "toy_survey" and train.spec.names == ("colour", "magnitude", "distance")
    assert json.loads((results / "data" / "features.json").read_text())["figures"] == []  # no sky, no parallax
    for method in ("em", "minibatch_em"):
        metrics = json.loads((results / "fits" / method / "K2_seed0" / "metrics.json").read_text())
        assert metrics["n_components"] == 2 and np.isfinite(metrics["val"]["loglik"])
    figures = sorted(path.name for path in (results / "figures").glob("*.png"))
    assert figures == ["corner_em_K2.png", "corner_minibatch_em_K2.png", "timing_vs_K.png", "training_curves_K2.png"]
    assert (results / "tables" / "loglik.md").exists() and (results / "claims.md").exists()
    drawn = plot_corner(
        results / "fits" / "em" / "K2_seed0" / "model.npz",
        results / "data" / "test.parquet",
        [tmp_path / "corner.png"],
        n_samples=500,
    )
    assert list(drawn["outside"]) == ["g - r [mag]", "r [mag]", "distance [pc]"]  # the survey's own labels


def test_a_survey_that_cannot_be_used_is_refused_naming_it(monkeypatch):
    monkeypatch.syspath_prepend(str(SURVEYS))
    with pytest.raises(ValueError, match="survey 'no_such_survey': no module 'no_such_survey'"):
        survey_module("no_such_survey")
    with pytest.raises(ValueError, match="module json has no write_feature_splits"):
        survey_module("json")
    with pytest.raises(ValueError, match="survey 'no_spec': module no_spec has no SPEC, the FeatureSpec of its"):
        survey_module("no_spec")

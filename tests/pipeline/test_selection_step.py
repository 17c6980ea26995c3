"""The workflow's fit step under a selection: it cuts the training and validation splits by the limits,
fits aware of them (or not: the naive fit), and records the selection with the metrics."""

import json

import numpy as np
import pytest

from scalable_xd import XDGMM
from scalable_xd.fit.selection import Selection
from scalable_xd.pipeline.cli import main
from scalable_xd.pipeline.features_file import read_features

LIMIT = 19.0
G = 6  # phot_g_mean_mag's column


def _fit(files, out, *extra):
    args = ["-q", "fit", "--train", files / "data" / "train.parquet", "--val", files / "data" / "val.parquet"]
    args += ["--init", files / "init.npz", "--n-components", "3", "--method", "em", "--epochs", "4", "--tol", "none"]
    args += ["--acceleration", "none", "--dtype", "float64", "--seed", "0"]
    args += ["--output-model", out / "model.npz", "--output-metrics", out / "metrics.json", *extra]
    assert main([str(a) for a in args]) == 0
    return json.loads((out / "metrics.json").read_text()), np.load(out / "model.npz")


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.parametrize("aware", [True, False])
def test_the_fit_step_cuts_its_splits_and_fits_as_the_estimator_does(files, tmp_path, aware):
    spec = f"phot_g_mean_mag < {LIMIT}"
    extra = ["--selection", spec] + ([] if aware else ["--no-selection-aware"])
    metrics, model = _fit(files, tmp_path, *extra)
    train, val = (read_features(files / "data" / f"{name}.parquet") for name in ("train", "val"))
    kept, kept_val = (np.flatnonzero(split.X[:, G] < LIMIT) for split in (train, val))
    assert 0.2 < len(kept) / len(train) < 0.9  # the limit cuts the mock's catalogue
    assert metrics["train"]["n"] == len(kept) and metrics["val"]["n"] == len(kept_val)
    assert metrics["settings"]["selection"] == spec and metrics["settings"]["selection_aware"] is aware
    assert metrics["settings"]["selection_label"] == f"G < {LIMIT}"  # as the figures name the cut
    init = np.load(files / "init.npz")
    direct = XDGMM(
        3, method="em", epochs=4, tol=None, acceleration="none", dtype="float64", random_state=0,
        weights_init=init["weights"], means_init=init["means"],
    )  # fmt: skip
    selection = Selection(lambda v: (v[:, G] < LIMIT).astype(float)) if aware else None
    train, val = train.subset(kept), val.subset(kept_val)
    direct.fit(train.X, Xcov=train.covariance(), X_val=val.X, Xcov_val=val.covariance(), selection=selection)
    np.testing.assert_allclose(model["means"], direct.means_, rtol=1e-12, atol=1e-12)


def test_a_streamed_fit_step_refuses_a_selection(files, tmp_path, caplog):
    args = ["fit", "--train", files / "data" / "train.parquet", "--init", files / "init.npz", "--n-components", "3"]
    args += ["--selection", "phot_g_mean_mag < 19", "--stream-window", "500", "--tol", "none"]
    args += ["--acceleration", "none", "--output-model", tmp_path / "m.npz", "--output-metrics", tmp_path / "m.json"]
    assert main([str(a) for a in args]) == 1
    assert "the workflow cuts its splits in memory; set fit.stream_window 0" in caplog.text

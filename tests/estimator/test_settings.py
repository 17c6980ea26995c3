"""Every default and constraint of a fit is written once, in scalable_xd.settings; the estimator, the
command line, the workflow's schema and the configs all agree with it."""

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml

from scalable_xd import XDGMM
from scalable_xd.fit.methods import SETTING_CHOICES, for_data
from scalable_xd.pipeline.cli import build_parser
from scalable_xd.pipeline.fit_steps import REFERENCE
from scalable_xd.settings import FitSettings, KMeansSettings

REPO = Path(__file__).resolve().parents[2]
SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())["properties"]
WORKFLOW_FIT_KEYS = {
    "methods",
    "variants",
    "n_components",
    "seeds",
    "threads",
    "processes",
    "nodes",
    "stream_window",
    "checkpoint_every",
    "job_per_seed",
}  # the grid, not settings
WORKFLOW_INIT_KEYS = {"kmeans_max_rows"}  # which stars k-means sees, not how it runs


def _subparser(name):
    return build_parser()._subparsers._group_actions[0].choices[name]


def _option_defaults(name) -> dict:
    return {a.dest: a.default for a in _subparser(name)._actions}


def test_the_estimator_takes_its_defaults_from_the_settings():
    signature = inspect.signature(XDGMM).parameters
    for name, default in FitSettings.defaults().items():
        assert signature[name].default == default, name
    for name, default in KMeansSettings.defaults().items():
        assert signature[f"kmeans_{name}"].default == default, name
    extra = set(signature) - set(FitSettings.defaults()) - {f"kmeans_{k}" for k in KMeansSettings.defaults()}
    assert extra == {
        "n_components",
        "random_state",
        "warm_start",
        "weights_init",
        "means_init",
        "covariances_init",
        "fix_weights",
        "fix_means",
        "fix_covariances",
    }


def test_the_estimator_documents_every_parameter_with_the_settings_default():
    """numpydoc's own parser reads XDGMM's docstring: each constructor parameter has an entry, and each
    setting's entry states the default the estimator takes (the entries are generated, so they cannot
    fall behind a changed default, as the step-size schedule's once did)."""
    from numpydoc.docscrape import ClassDoc

    documented = {}
    for entry in ClassDoc(XDGMM, config={"show_class_members": False})["Parameters"]:
        for name in entry.name.split(", "):
            documented[name] = entry
    assert set(documented) == set(inspect.signature(XDGMM).parameters)
    defaults = {**FitSettings.defaults(), **{f"kmeans_{k}": v for k, v in KMeansSettings.defaults().items()}}
    for name, default in defaults.items():
        assert documented[name].type.endswith(f"default={default!r}"), name
        assert documented[name].desc, name
    assert "default='step'" in documented["step_schedule"].type


def test_the_schema_states_the_same_defaults_and_choices():
    fit = SCHEMA["fit"]["properties"]
    assert set(fit) - WORKFLOW_FIT_KEYS == set(FitSettings.defaults()) - {"method", "verbose"}
    for f in dataclasses.fields(FitSettings):
        if f.name in fit:
            assert fit[f.name]["default"] == f.default, f.name
            choices = SETTING_CHOICES.get(f.name, f.metadata["choices"])  # the method table's, the kernel's
            if choices is not None:
                assert tuple(fit[f.name]["enum"]) == tuple(choices), f.name
    variant_methods = SCHEMA["fit"]["properties"]["variants"]["additionalProperties"]["properties"]["method"]["enum"]
    assert tuple(variant_methods) == SETTING_CHOICES["method"]  # fit.methods
    init = SCHEMA["init"]["properties"]
    assert {k: v["default"] for k, v in init.items() if k not in WORKFLOW_INIT_KEYS} == {
        f"kmeans_{k}": v for k, v in KMeansSettings.defaults().items()
    }
    truth = SCHEMA["truth"]["properties"]
    assert (truth["reference_epochs"]["default"], truth["reference_tol"]["default"]) == (
        REFERENCE.epochs,
        REFERENCE.tol,
    )


def test_the_command_line_states_the_same_defaults():
    fit = _option_defaults("fit")
    for name, default in FitSettings.defaults().items():
        if name != "verbose":
            assert fit[name] == default, name
    kmeans = _option_defaults("kmeans")
    assert (kmeans["epochs"], kmeans["batch_size"]) == (KMeansSettings().epochs, KMeansSettings().batch_size)
    reference = _option_defaults("reference")
    assert (reference["epochs"], reference["tol"], reference["dtype"]) == (REFERENCE.epochs, REFERENCE.tol, "float64")


@pytest.mark.parametrize(
    "name", ["config", "mock", "demo", "midscale", "methods", "split_merge", "converge", "smoke", "gaia_full"]
)
def test_configs_state_only_what_differs_from_the_defaults(name):
    config = yaml.safe_load((REPO / "config" / f"{name}.yaml").read_text())
    defaults = {**FitSettings.defaults(), **{f"kmeans_{k}": v for k, v in KMeansSettings.defaults().items()}}
    for block in ("fit", "init"):
        for key, value in config.get(block, {}).items():
            if key not in WORKFLOW_FIT_KEYS | WORKFLOW_INIT_KEYS:
                assert value != defaults[key], f"{name}.yaml {block}.{key} repeats the default {value!r}"


def test_a_setting_out_of_range_is_named():
    with pytest.raises(ValueError, match="kappa must be in \\(0.5, 1\\], got 0.4"):
        FitSettings(kappa=0.4)
    with pytest.raises(ValueError, match="unknown step_schedule 'linear': choose one of step, cappe_moulines"):
        FitSettings(step_schedule="linear")
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        KMeansSettings(batch_size=0)


def test_each_method_has_its_own_budget_resolved_for_the_data():
    """None: batch EM 100 iterations at most, minibatch EM 20 epochs or as many as 3,000 updates of 500
    points take, SGD 20 epochs or 6,000 updates, but no more than batch EM's 100 passes where an epoch
    makes 20 updates (below 10,000 points the batch shrinks so that it does); the decay after half of them.
    A budget given is kept."""
    budgets = {
        (method, n): for_data(FitSettings(method=method), n)
        for method in ("em", "minibatch_em", "sgd")
        for n in (894, 80_000, 400_000, 1_600_000)
    }
    assert [budgets["em", n].epochs for n in (894, 80_000, 1_600_000)] == [100, 100, 100]
    assert [budgets["minibatch_em", n].batch_size for n in (894, 80_000, 1_600_000)] == [44, 500, 500]
    assert [budgets["minibatch_em", n].epochs for n in (894, 80_000, 1_600_000)] == [100, 20, 20]  # 20, 160 batches
    assert [budgets["sgd", n].epochs for n in (894, 80_000, 400_000, 1_600_000)] == [100, 38, 20, 20]
    assert [budgets["sgd", n].decay_epoch for n in (894, 80_000, 400_000, 1_600_000)] == [50, 19, 10, 10]
    assert [for_data(FitSettings(), n).batch_size for n in (10, 700, 9_999, 10_000)] == [8, 35, 499, 500]
    given = for_data(FitSettings(method="sgd", epochs=7, decay_epoch=3), 80_000)
    assert (given.epochs, given.decay_epoch) == (7, 3)
    assert for_data(FitSettings(method="sgd", epochs=1), 10).decay_epoch == 1  # one epoch: its full step

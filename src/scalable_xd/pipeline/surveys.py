"""The surveys a features file is built from. A survey is a module with

    SPEC: FeatureSpec
    write_feature_splits(raw, out_dir, *, mode: str, split_seed: int) -> dict

that reads its raw catalogue at ``raw`` and writes ``train/val/test.parquet`` through
``features_file.write_splits`` (``SPEC`` travelling in each file's metadata), returning a summary for the
log; ``mode`` is the workflow's ``data.covariance_mode``, which the survey may refuse; ``SPEC`` says
which roles its features play, and so which figures apply (``report.figures_for``). The
workflow's ``data.survey`` (and ``scalable-xd features --survey``) names it: a short name below, or any
importable module, so that a new survey is its module and its config, with no change here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .features_file import FeatureSpec

# The surveys that ship with the package, by short name.
SURVEYS = {"gaia_dr2": "scalable_xd.pipeline.gaia.storage"}


def survey_module(name: str) -> ModuleType:
    """The module of survey ``name`` (a short name of ``SURVEYS``, or a module's dotted path), checked to
    have ``write_feature_splits``."""
    path = SURVEYS.get(name, name)
    try:
        module = importlib.import_module(path)
    except ImportError as err:
        raise ValueError(
            f"survey {name!r}: no module {path!r} ({err}); give one of {', '.join(SURVEYS)} or an importable module"
        ) from None
    if not callable(getattr(module, "write_feature_splits", None)):
        raise ValueError(
            f"survey {name!r}: module {path} has no write_feature_splits(raw, out_dir, *, mode, split_seed)"
        )
    if not isinstance(getattr(module, "SPEC", None), FeatureSpec):
        raise ValueError(f"survey {name!r}: module {path} has no SPEC, the FeatureSpec of its features")
    return module

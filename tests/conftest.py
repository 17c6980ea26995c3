"""Fixtures shared by several test modules."""

import os
from contextlib import contextmanager

import pytest
import torch

# Without a GPU the Triton kernel's tests (test_triton.py) run through Triton's interpreter, which must be
# chosen before triton is first imported (triton.language's own jit functions are made then).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import scalable_xd.deferred_checks
import scalable_xd.fit.driver
import scalable_xd.fit.plan
import scalable_xd.fit.rules.forms
import scalable_xd.fit.run.checkpoint
from scalable_xd.pipeline.cli import main


@pytest.fixture(autouse=True)
def one_start_at_the_default(request, monkeypatch):
    """In this process the default ``n_init=None`` takes one start where it would take three, unless a test
    is marked ``default_starts``: most tests check a fit's mechanics (paths that agree, files, refusals), which
    three starts on small data would check three times at three times the cost. The tests of the default
    itself (test_restarts.py) are so marked; subprocesses (the workflow, the command line) keep it."""
    if "default_starts" not in request.keywords:
        monkeypatch.setattr(scalable_xd.fit.plan, "AUTO_STARTS", 1)


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """A raw mock catalogue, its feature splits and a k-means init, made through the CLI itself."""
    root = tmp_path_factory.mktemp("cli")
    assert main(["-q", "mock", "--n-rows", "3000", "--seed", "1", "--output", str(root / "raw.parquet")]) == 0
    assert main(["-q", "features", "--input", str(root / "raw.parquet"), "--out-dir", str(root / "data")]) == 0
    assert (
        main(
            [
                "-q",
                "kmeans",
                "--train",
                str(root / "data" / "train.parquet"),
                "--n-components",
                "3",
                "--output",
                str(root / "init.npz"),
            ]
        )
        == 0
    )
    return root


@pytest.fixture
def killed_after_checkpoint(monkeypatch):
    """A context in which a fit stops as a killed job would (a KeyboardInterrupt, which the context expects)
    right after it writes its checkpoint of ``epoch`` (of ``batch`` inside it, where given)."""

    @contextmanager
    def killed(epoch: int, batch: int | None = None):
        save = scalable_xd.fit.run.checkpoint.save

        def save_then_crash(path, **state):
            save(path, **state)
            if state["epoch"] == epoch and (batch is None or state.get("batch") == batch):
                raise KeyboardInterrupt

        with monkeypatch.context() as patch:
            patch.setattr(scalable_xd.fit.run.checkpoint, "save", save_then_crash)
            with pytest.raises(KeyboardInterrupt):
                yield

    return killed


@pytest.fixture
def gpu_path(monkeypatch):
    """Fits on the CPU taking the GPU's path: torch updates (not the compiled CPU ones), checks deferred
    (graphs as each test says)."""
    monkeypatch.setattr(scalable_xd.fit.rules.forms, "compiled", lambda fitter, device: None)
    monkeypatch.setattr(scalable_xd.deferred_checks, "defers_on", lambda device: True)

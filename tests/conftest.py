"""Fixtures shared by several test modules."""

import os

import pytest
import torch

# Without a GPU the Triton kernel's tests (test_triton.py) run through Triton's interpreter, which must be
# chosen before triton is first imported (triton.language's own jit functions are made then).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from scalable_xd.pipeline.cli import main


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

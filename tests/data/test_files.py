"""Atomic output: files appear whole or not at all, with the mode that the umask gives any new file."""

import os
import stat

import numpy as np
import pytest

from scalable_xd import XDGMM
from scalable_xd.files import atomic_path, write_json


@pytest.fixture
def umask():
    """Set the process umask for one test and restore it afterwards."""
    saved = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(saved)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077, 0o027])
def test_outputs_get_the_mode_the_umask_gives(umask, tmp_path, mask):
    umask(mask)
    write_json(tmp_path / "metrics.json", {"a": 1})
    XDGMM(1, epochs=1, device="cpu").fit(np.random.default_rng(0).normal(size=(50, 2))).save(tmp_path / "model.npz")
    with open(tmp_path / "plain.txt", "w"):  # what `open` gives, the behaviour to match
        pass
    for name in ("metrics.json", "model.npz", "plain.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask, name


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    write_json(target, {"old": True})
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash while writing")
    assert target.read_text().strip().startswith("{") and '"old": true' in target.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]

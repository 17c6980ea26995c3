"""The D x D algebra of the statistics pass as source lines, one scalar per matrix entry, shared by the
kernels whose source is generated per dimension (``fused`` for numba, ``triton_pass`` for Triton).

Names: ``d{i}`` the residual x - m, ``p{j}`` the pivots, ``l{i}_{j}`` the Cholesky factor L of
T = V + S, ``w{i}_{j}`` its inverse W = L^-1 (``w{j}_{j}`` = 1 / L_jj), ``z{i}`` = (L^-1 d)_i; then
u = T^-1 d = W^T z and T^-1 = W^T W. Each kernel says how an entry of V and of S is read, and how to
take a square root and write the constant one.

A generated module is written into the kernel cache folder and imported from there (``import_generated``):
numba's on-disk cache and Triton's compiler both read a kernel's source from its file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path


def tri(i: int, j: int) -> int:
    """Position of entry (i, j), j <= i, in a row-major lower triangle."""
    return i * (i + 1) // 2 + j


def cache_folder() -> Path:
    """Where the kernels' sources and numba's compiled code are kept: $SCALABLE_XD_CACHE, or
    $XDG_CACHE_HOME/scalable_xd (~/.cache/scalable_xd)."""
    if "SCALABLE_XD_CACHE" in os.environ:
        return Path(os.environ["SCALABLE_XD_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scalable_xd"


def import_generated(stem: str, source: str):
    """The module of ``source``, written once (atomically) into ``cache_folder()`` as ``<stem>_<digest>.py``
    and imported under that name, so that a later process finds the same file; OSError where the folder
    cannot be written."""
    name = f"{stem}_{hashlib.sha1(source.encode()).hexdigest()[:12]}"
    path = cache_folder() / "kernels" / f"{name}.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(source)
        os.replace(partial, path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the generated kernel module {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # numba's cache re-imports it by name
    spec.loader.exec_module(module)
    return module


def factorise_and_solve(
    dim: int, v: Callable[[int, int], str], s: Callable[[int, int], str], sqrt: str, one: str
) -> list[str]:
    """Pivots, L, 1 / L_jj and z = L^-1 d, given the residuals ``d{i}``; ``v(i, j)`` and ``s(i, j)`` read
    the entries (i >= j) of V and S."""
    lines = []
    for j in range(dim):
        for i in range(j, dim):
            terms = " - ".join([f"{v(i, j)} + {s(i, j)}"] + [f"l{i}_{m} * l{j}_{m}" for m in range(j)])
            if i == j:
                lines += [f"p{j} = {terms}", f"l{j}_{j} = {sqrt}(p{j})", f"w{j}_{j} = {one} / l{j}_{j}"]
            else:
                lines.append(f"l{i}_{j} = ({terms}) * w{j}_{j}")
    for i in range(dim):
        terms = " - ".join([f"d{i}"] + [f"l{i}_{m} * z{m}" for m in range(i)])
        lines.append(f"z{i} = ({terms}) * w{i}_{i}")
    return lines


def invert_factor(dim: int) -> list[str]:
    """The off-diagonal entries of W = L^-1 (lower triangular)."""
    lines = []
    for i in range(dim):
        for j in range(i):
            terms = " + ".join(f"l{i}_{m} * w{m}_{j}" for m in range(j, i))
            lines.append(f"w{i}_{j} = -({terms}) * w{i}_{i}")
    return lines


def u_entry(dim: int, i: int) -> str:
    """(T^-1 d)_i = (W^T z)_i."""
    return " + ".join(f"w{m}_{i} * z{m}" for m in range(i, dim))


def t_inv_entry(dim: int, i: int, j: int) -> str:
    """(T^-1)_ij = (W^T W)_ij, j <= i."""
    return " + ".join(f"w{m}_{i} * w{m}_{j}" for m in range(i, dim))

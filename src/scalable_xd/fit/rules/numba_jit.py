"""How the CPU's forms of the rules are compiled (numba): cached, numpy's error model; helpers inlined."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba

# Typed as what they make of a function: numba's stubs give a compiled function's call no arguments.
jit: Callable[[Callable[..., Any]], Callable[..., Any]] = numba.njit(cache=True, error_model="numpy")


# Helpers of the update loops, inlined into them as numba compiles them: called, they cost a fifth of the step
jit_inline: Callable[[Callable[..., Any]], Callable[..., Any]] = numba.njit(
    cache=True, error_model="numpy", inline="always"
)


jit_parallel: Callable[[Callable[..., Any]], Callable[..., Any]] = numba.njit(
    cache=True, error_model="numpy", parallel=True
)

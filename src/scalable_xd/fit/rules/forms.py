"""Which form of a rule runs where: the CPU's compiled (numba) form a fitter's every update takes, and the
Triton kernels a replayed CUDA step launches. Read as each fitter or step is made: tests and benchmarks
replace them (the torch rule on the CPU; the Triton kernels through Triton's interpreter)."""

from __future__ import annotations

import importlib.util
from importlib import import_module
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..fitters import CompiledRule, Fitter

# The CPU's compiled forms, by the rule's name (``Fitter.rule``): module and class.
NUMBA = {"online_em": (".online_em_numba", "OnlineEMArrays"), "sgd": (".sgd_numba", "AdamArrays")}


def compiled(fitter: Fitter, device: torch.device) -> CompiledRule | None:
    """``fitter``'s rule compiled, bound to it, where its parameters are on the CPU and numba is installed;
    None where its own torch rule runs (other devices: a replayed CUDA step takes its own form)."""
    if device.type != "cpu" or fitter.rule not in NUMBA or importlib.util.find_spec("numba") is None:
        return None
    module, name = NUMBA[fitter.rule]
    form = getattr(import_module(module, __package__), name)
    return form(fitter) if form.accepts(fitter) else None


def triton_form(rule: str, device: torch.device) -> ModuleType | None:
    """The Triton kernels of ``rule`` (``online_em_triton``, ``sgd_triton``) where they run: on CUDA with
    triton installed; None elsewhere, where torch's update runs."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    return import_module(f".{rule}_triton", __package__)

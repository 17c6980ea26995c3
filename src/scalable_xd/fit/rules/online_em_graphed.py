"""Online EM's step as a replayed CUDA-graph step takes it (``engines.cuda``): the host's part apart from the
device's, written in place; the update one Triton kernel (``online_em_triton``) where triton runs, torch's
elsewhere."""

from __future__ import annotations

from types import ModuleType

import torch

from ... import deferred_checks
from ...kernel.statistics import Statistics
from ...mixture import Mixture
from . import forms
from .em import regularised, share_weights, stacked_fixed
from .online_em import OnlineEMFitter, online_em_update


class GraphedOnlineEM:
    """Online EM's step (``online_em.online_em_update``, then ``regularised``; less truncation) as a replayed
    step takes it, on a ``MinibatchEM``: the update one Triton kernel where triton is installed
    (``online_em_triton``), torch's in place elsewhere."""

    READS = slice(3, 6)  # which of ``live_tensors`` the statistics pass reads: the E-step mixture's

    @staticmethod
    def accepts(fitter: OnlineEMFitter) -> bool:
        """Not the naive update (kept for study) nor truncation (its restarts ask the host)."""
        return not fitter.naive and fitter.truncation is None

    def __init__(self, fitter: OnlineEMFitter):
        self.fitter = fitter
        self.kernel = forms.triton_form("online_em", fitter.state.means.device)
        self._step: torch.Tensor | None = None  # the step size on the device (``prepare_step``)
        self._constants: torch.Tensor | None = None  # (the prior's data size or 0, float64's tiny)
        self._prior_size: float | None = None  # what ``_constants`` holds of it

    @property
    def mixture(self) -> Mixture:
        return self.fitter.mixture

    def live_tensors(self) -> list[torch.Tensor]:
        """The tensors a step reads and writes: the running state's and the E-step mixture's."""
        return [*self.fitter.state.tensors(), *self.fitter.mixture.tensors()]

    def bind(self, tensors: list[torch.Tensor]) -> None:
        self.fitter.bind(Mixture(*tensors[:3]), Mixture(*tensors[3:]))

    def prepare_step(self) -> None:
        """The host's part of the next step: its step size (and the prior's data size, where it changed),
        filled into scalars on the device (filled, not copied: no wait)."""
        fitter, device = self.fitter, self.fitter.state.means.device
        if self._step is None:
            self._step = torch.zeros((), dtype=torch.float64, device=device)
            self._constants = torch.full((2,), torch.finfo(torch.float64).tiny, dtype=torch.float64, device=device)
        self._step.fill_(fitter.next_step_size())
        fitter.n_updates += 1
        size = 0.0 if fitter.data_size is None or fitter.w is None else float(fitter.data_size)  # 0: no prior
        if size != self._prior_size:
            self._constants[0].fill_(size)  # type: ignore[index]
            self._prior_size = size

    def step_in_place(self, stats: Statistics) -> None:
        """The update written into ``live_tensors``, asking the host nothing."""
        fitter, step = self.fitter, self._step
        if step is None:
            raise RuntimeError("prepare_step sets the step size on the device before step_in_place")
        fixed = fitter.fixed_parameters
        if self.kernel is not None:
            e_step = fitter.mixture
            suspect = self.kernel.online_em_step_in_place(
                fitter.state, e_step, stats, step, fitter.w, fixed, self._constants
            )
            checks = deferred_checks.active()
            if checks is None:
                raise RuntimeError("the graphed step runs with its checks deferred (GraphedStep)")
            checks.note(suspect)  # a covariance rounding left indefinite: the epoch runs again
            self.share_fixed_weights()
            return
        state = online_em_update(fitter.state, stats.double(), step, fitter.w, fixed, fitter.data_size)
        e_step = regularised(state, fitter.w, fitter.fixed, fitter.data_size)
        for live, new in zip(self.live_tensors(), [*state.tensors(), *e_step.tensors()]):
            live.copy_(new)

    def share_fixed_weights(self) -> None:
        """After the kernel's update, where any parameter is fixed, the E-step's weights shared and the fixed
        ones restored, as ``regularised`` does (a host test made once: ``FixedParameters.any``)."""
        fitter, fixed = self.fitter, self.fitter.fixed_parameters
        if fixed.any():
            fitter.mixture.weights.copy_(share_weights(fitter.state.weights, fixed.weight_values, fixed.weights))

    def device_scalars(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step size and constants ``prepare_step`` sets on the device, for a step taken with others."""
        if self._step is None or self._constants is None:
            raise RuntimeError("prepare_step sets the step size on the device first")
        return self._step, self._constants

    @staticmethod
    def update_together(kernel: ModuleType, rules: list[GraphedOnlineEM], live: list[torch.Tensor]):
        """Online EM's update of F fits in one launch of its kernel (``online_em_triton``), their tensors ``live``
        (each of ``live_tensors`` stacked): a function of their stacked sums and their engines, which notes
        each fit's suspect covariances in its own flag."""
        fitters = [rule.fitter for rule in rules]
        fixed = stacked_fixed([fitter.fixed_parameters for fitter in fitters])
        dim = live[1].shape[-1]
        w = torch.stack([f.w if f.w is not None else live[1].new_zeros(dim) for f in fitters])

        def update(stacked: Statistics, engines: list) -> None:
            scalars = [rule.device_scalars() for rule in rules]
            suspect = kernel.online_em_step_in_place(
                Mixture(*live[:3]),
                Mixture(*live[3:]),
                stacked,
                torch.stack([step for step, _ in scalars]),
                w,
                fixed,
                torch.stack([constants for _, constants in scalars]),
            )
            for f, (engine, rule) in enumerate(zip(engines, rules)):
                engine.checks.note(suspect[f])  # a covariance rounding left indefinite: its epoch runs again
                rule.share_fixed_weights()

        return update

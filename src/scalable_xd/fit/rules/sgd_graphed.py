"""SGD's step as a replayed CUDA-graph step takes it (``engines.cuda``): Adam's corrections set on the device
by the host, the step written in place; two Triton kernels (``sgd_triton``) where triton runs, torch's
elsewhere."""

from __future__ import annotations

from types import ModuleType

import torch

from ...kernel.statistics import Statistics
from ...mixture import Mixture
from . import forms
from .em import stacked_fixed
from .sgd import SGDFitter


class GraphedAdam:
    """SGD's gradient and Adam's step as a replayed step takes them, on an ``SGD``: two Triton kernels where
    triton is installed (``sgd_triton``), torch's in place elsewhere; Adam's bias corrections set on the
    device by the host before each step (``Adam.step_on_device``)."""

    @staticmethod
    def accepts(fitter: SGDFitter) -> bool:
        """Not with fixed weights (the free ones are selected by a mask, asking the host)."""
        return not fitter.params.fixed.has_fixed_weights

    READS = slice(0, 3)  # which of ``live_tensors`` the statistics pass reads: the mixture's

    def __init__(self, fitter: SGDFitter):
        self.fitter = fitter
        self.kernel = forms.triton_form("sgd", fitter.mixture.means.device)
        self._adam_scalars: torch.Tensor | None = (
            None  # (step size, sqrt(1 - beta2^t), beta1, beta2, eps) on the device
        )
        means = fitter.mixture.means
        self.w = means.new_ones(means.shape[-1]) if fitter.w is None else fitter.w  # W's diagonal, 1 for none
        self.penalised = torch.tensor(fitter.w is not None, dtype=torch.int8, device=means.device)

    @property
    def mixture(self) -> Mixture:
        return self.fitter.mixture

    def live_tensors(self) -> list[torch.Tensor]:
        """The tensors a step reads and writes: the mixture's, the parameters' (logits, means, raw factors)
        and their scale, Adam's moments (first, second) and the fixed components' initial means and
        covariances."""
        params, adam = self.fitter.params, self.fitter.optimizer
        initial = params.initial
        return [
            *self.fitter.mixture.tensors(),
            *params.tensors(),
            params.scale,
            *adam.exp_avg,
            *adam.exp_avg_sq,
            initial.means,
            initial.covariances,
        ]

    def bind(self, tensors: list[torch.Tensor]) -> None:
        fitter = self.fitter
        params, adam = fitter.params, fitter.optimizer
        fitter.mixture = Mixture(*tensors[:3])
        params.logits, params.means, params.raw, params.scale = tensors[3:7]
        adam.params = params.tensors()
        adam.exp_avg, adam.exp_avg_sq = list(tensors[7:10]), list(tensors[10:13])
        params.initial = Mixture(params.initial.weights, *tensors[13:15])

    def prepare_step(self) -> None:
        """The host's part of the next step: Adam's step count and corrections, into the device."""
        optimizer = self.fitter.optimizer
        if self._adam_scalars is None:
            self._adam_scalars = torch.tensor(
                [0.0, 1.0, *optimizer.betas, optimizer.eps],
                dtype=torch.float64,
                device=self.fitter.mixture.means.device,
            )
        optimizer.steps += 1
        for slot, value in zip(self._adam_scalars, optimizer.corrections()):
            slot.fill_(value)

    def device_scalars(self) -> torch.Tensor:
        """Adam's constants that ``prepare_step`` sets on the device, for a step taken with others."""
        if self._adam_scalars is None:
            raise RuntimeError("prepare_step sets Adam's corrections on the device first")
        return self._adam_scalars

    def step_in_place(self, stats: Statistics) -> None:
        """The Adam step, its mixture written into ``live_tensors``, asking the host nothing."""
        adam = self.device_scalars()
        fitter, params, optimizer = self.fitter, self.fitter.params, self.fitter.optimizer
        if self.kernel is not None:
            self.kernel.sgd_step_in_place(
                tuple(params.tensors()),
                params.scale,
                (tuple(optimizer.exp_avg), tuple(optimizer.exp_avg_sq)),
                stats,
                adam[None],
                self.w,
                self.penalised,
                params.fixed,
                (params.initial.means, params.initial.covariances),
                fitter.mixture,
            )
            return
        optimizer.step_on_device(params.loss_gradients(stats.double(), fitter.w), adam)
        for live, new in zip(fitter.mixture.tensors(), params.mixture().tensors()):
            live.copy_(new)

    @staticmethod
    def update_together(kernel: ModuleType, rules: list[GraphedAdam], live: list[torch.Tensor]):
        """SGD's step of F fits in one launch of each kernel (``sgd_triton``), their tensors ``live`` (each
        of ``live_tensors`` stacked): a function of their stacked sums and their engines."""
        fixed = stacked_fixed([rule.fitter.params.fixed for rule in rules])
        w = torch.stack([rule.w for rule in rules])
        penalised = torch.stack([rule.penalised for rule in rules])

        def update(stacked: Statistics, engines: list) -> None:
            kernel.sgd_step_in_place(
                tuple(live[3:6]),
                live[6],
                (tuple(live[7:10]), tuple(live[10:13])),
                stacked,
                torch.stack([rule.device_scalars() for rule in rules]),
                w,
                penalised,
                fixed,
                (live[13], live[14]),
                Mixture(*live[:3]),
            )

        return update

"""Adam (Kingma & Ba 2015) as ``torch.optim.Adam`` computes it, with its step count kept on the host.

``torch.optim.Adam`` keeps the step count as a tensor and reads it back every step to form the bias
corrections, which on a GPU makes each step wait for the device (unless ``capturable``, which the CPU
does not support). SGD's parameters are few and their gradients come analytically from the kernel's sums,
so this is all the optimiser the fit needs: the same arithmetic as torch's single-tensor step (no weight
decay, amsgrad or maximize; ``tests/fit/test_cpu_rules.py`` holds the two equal to the bit), and a state
that the compiled CPU step (``engines.cpu_rules.sgd_step``) updates in place.
"""

from __future__ import annotations

import math

import torch


class Adam:
    """Adam over ``params`` (tensors updated in place) with learning rate ``lr`` (settable between steps)."""

    def __init__(self, params: list[torch.Tensor], lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        self.params = params
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.steps = 0
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]

    def corrections(self) -> tuple[float, float]:
        """(the step size lr / (1 - beta1^t), sqrt(1 - beta2^t)) for the step count t."""
        beta1, beta2 = self.betas
        return self.lr / (1 - beta1**self.steps), math.sqrt(1 - beta2**self.steps)

    def step(self, grads: list[torch.Tensor]) -> None:
        """One step along ``grads`` (one per parameter)."""
        self.steps += 1
        step_size, bias_correction2_sqrt = self.corrections()
        for param, exp_avg, denom in self._moments(grads, bias_correction2_sqrt):
            param.addcdiv_(exp_avg, denom, value=-step_size)

    def step_on_device(self, grads: list[torch.Tensor], corrections: torch.Tensor) -> None:
        """The step with its ``corrections()`` read from a (2,) tensor on the parameters' device, set before
        the step (``steps`` counted by the caller), as a replayed CUDA graph needs (``engines.cuda``); equal
        to ``step`` up to the rounding of the last multiply-add."""
        step_size, bias_correction2_sqrt = corrections[0], corrections[1]
        for param, exp_avg, denom in self._moments(grads, bias_correction2_sqrt):
            param.sub_(step_size * (exp_avg / denom))

    def _moments(self, grads: list[torch.Tensor], bias_correction2_sqrt):
        """Update the moment estimates in place; yield (parameter, first moment, step's denominator)."""
        beta1, beta2 = self.betas
        for param, grad, exp_avg, exp_avg_sq in zip(self.params, grads, self.exp_avg, self.exp_avg_sq):
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            yield param, exp_avg, (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "exp_avg": [t.clone() for t in self.exp_avg],
            "exp_avg_sq": [t.clone() for t in self.exp_avg_sq],
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        for mine, saved in zip(self.exp_avg + self.exp_avg_sq, state["exp_avg"] + state["exp_avg_sq"]):
            mine.copy_(saved)

"""SGD's rule (paper section 3.2) in torch: the unconstrained parameters (softmax logits, means, Cholesky
factors), their loss's gradient from the kernel's sums, and Adam's step; the definition the compiled forms
beside it (``sgd_numba``, ``sgd_triton``) follow.

Adam (Kingma & Ba 2015) as ``torch.optim.Adam`` computes it, with its step count kept on the host.

``torch.optim.Adam`` keeps the step count as a tensor and reads it back every step to form the bias
corrections, which on a GPU makes each step wait for the device (unless ``capturable``, which the CPU
does not support). SGD's parameters are few and their gradients come analytically from the kernel's sums,
so this is all the optimiser the fit needs: the same arithmetic as torch's single-tensor step (no weight
decay, amsgrad or maximize; ``tests/fit/test_cpu_rules.py`` holds the two equal to the bit), and a state
that the compiled CPU step (``sgd_numba.sgd_step``) updates in place.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from ...kernel.statistics import Statistics
from ...mixture import Mixture
from .em import FixedParameters, ridge_vector, share_weights


def component_scale(mixture: Mixture) -> torch.Tensor:
    """Each component's spread in each feature, sqrt(diag V_j), (K, D): SGD's units with ``"component"``."""
    return torch.sqrt(torch.diagonal(mixture.covariances, dim1=-2, dim2=-1))


def feature_scale(mixture: Mixture) -> torch.Tensor:
    """Each feature's spread under the mixture: the square root of the diagonal of its total covariance
    sum_j alpha_j (V_j + m_j m_j^T) - mbar mbar^T. SGD's parameters are measured in these units."""
    alpha = mixture.weights / mixture.weights.sum()
    mean = alpha @ mixture.means
    second = torch.einsum("k,kd->d", alpha, torch.diagonal(mixture.covariances, dim1=-2, dim2=-1) + mixture.means**2)
    return torch.sqrt((second - mean**2).clamp_min(torch.finfo(mean.dtype).tiny))


class CholeskyParameters:
    """Unconstrained SGD parameters (paper eq. 8): softmax logits, means, and Cholesky factors whose
    diagonal is stored as its logarithm, all in units of a ``scale`` s_j per component and feature (K, D):

        m_j = s_j * mu_j,    L_j = diag(s_j) Lt_j,    V_j = L_j L_j^T,

    where ``raw`` holds the strictly-lower part and log-diagonal of Lt_j. With s = 1 this is the paper's
    parametrisation, in which Adam moves a mean by about ``lr`` per step whatever the feature's units: 1e-2
    degrees of right ascension (spread ~100 deg) or mas of parallax (spread ~0.3 mas) alike, so the wide
    features take thousands of steps to move. With s the data's spread (``feature_scale``, the same for
    every component) a step of ``lr`` is the same fraction of every feature's range; with s_j component
    j's own starting spread (``component_scale``) the same fraction of the component's width, so that a
    component a thousand times narrower than the data is not shaken off its place by steps of the data's
    size.
    """

    def __init__(self, mixture: Mixture, scale: torch.Tensor | None = None, fixed: FixedParameters | None = None):
        self.scale = (
            torch.ones_like(mixture.means) if scale is None else scale.to(mixture.means).expand_as(mixture.means)
        )
        # Fixed parameters get zero gradients, and are reported as given (not through a round trip that
        # could change their last bit); fixed weights keep their values and the free ones share the rest.
        self.fixed = fixed or FixedParameters.none(mixture.n_components, mixture.means.device)
        self.initial = mixture
        chol = torch.linalg.cholesky(mixture.covariances) / self.scale[:, :, None]
        self.logits = torch.log(mixture.weights.clamp_min(torch.finfo(mixture.weights.dtype).tiny)).clone()
        self.means = mixture.means / self.scale
        self.raw = torch.tril(chol, -1) + torch.diag_embed(torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)))

    def tensors(self) -> list[torch.Tensor]:
        return [self.logits, self.means, self.raw]

    def _unit_cholesky(self) -> torch.Tensor:
        return torch.tril(self.raw, -1) + torch.diag_embed(torch.exp(torch.diagonal(self.raw, dim1=-2, dim2=-1)))

    def cholesky(self) -> torch.Tensor:
        return self.scale[:, :, None] * self._unit_cholesky()

    def _free_softmax(self) -> torch.Tensor:
        """Softmax over the free components' logits (the fixed ones get zero)."""
        if not self.fixed.has_fixed_weights:
            return torch.softmax(self.logits, dim=0)
        return torch.softmax(self.logits.masked_fill(self.fixed.weights, -torch.inf), dim=0)

    def mixture(self) -> Mixture:
        chol = self.cholesky()
        fixed, initial = self.fixed, self.initial
        weights = self._free_softmax()
        if fixed.has_fixed_weights:
            weights = share_weights(weights, fixed.weight_values, fixed.weights)
        means = torch.where(fixed.means[:, None], initial.means, self.means * self.scale)
        covariances = torch.where(fixed.covariances[:, None, None], initial.covariances, chol @ chol.mT)
        return Mixture(weights, means, covariances)

    def loss_gradients(self, stats: Statistics, w: float | torch.Tensor | None) -> list[torch.Tensor]:
        """Gradients of loss = -sum_batch log p(x_i) + sum_j 1 / tr(W^-1 V_j) for (logits, means, raw), the
        penalty the paper's sum_j w / tr(V_j) where W = w I, and nothing where w is None.

        From the sums: dLL/dm_j = U_j, dLL/dV_j = (UU_j - P_j)/2, dLL/dz_j = q_j - B alpha_j, chained through
        V = L L^T (dV/dL: 2 G L for symmetric G), L = diag(s) Lt (row i times s_i), Lt_qq = exp(raw_qq) and
        m = s mu.
        """
        w = ridge_vector(w, self.means)
        unit = self._unit_cholesky()
        chol = self.scale[:, :, None] * unit
        cov = chol @ chol.mT
        weights = torch.softmax(self.logits, dim=0)
        grad_cov = -0.5 * (stats.UU - stats.P)
        if w is not None:  # d(1 / T)/dV_dd = -1 / (T^2 w_d), T = tr(W^-1 V)
            trace = (torch.diagonal(cov, dim1=-2, dim2=-1) / w).sum(-1)
            grad_cov = grad_cov - torch.diag_embed(1.0 / (trace[:, None] ** 2 * w))
        grad_unit = self.scale[:, :, None] * torch.tril(2.0 * grad_cov @ chol)
        diag = torch.diagonal(grad_unit, dim1=-2, dim2=-1) * torch.diagonal(unit, dim1=-2, dim2=-1)
        grad_raw = torch.tril(grad_unit, -1) + torch.diag_embed(diag)
        fixed = self.fixed
        if fixed.has_fixed_weights:  # free alpha_j = (1 - fixed sum) softmax_free(z)_j: dLL/dz_j = q_j - beta_j q_free
            beta = self._free_softmax()
            grad_logits = -(stats.q - beta * stats.q[~fixed.weights].sum()).masked_fill(fixed.weights, 0.0)
        else:
            grad_logits = -(stats.q - stats.n_points * weights)
        grad_means = (-stats.U * self.scale).masked_fill(fixed.means[:, None], 0.0)
        return [grad_logits, grad_means, grad_raw.masked_fill(fixed.covariances[:, None, None], 0.0)]


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


class SGDFitter(Protocol):
    """What SGD's compiled forms read and write of the fitter they are bound to (``fit.families.sgd.SGD``): its
    parameters, Adam, W and the mixture (a tensor, or arrays held between compiled steps)."""

    params: CholeskyParameters
    optimizer: Adam
    w: torch.Tensor | None
    mixture: Mixture

    def mixture_arrays(self) -> tuple: ...

    def hold(self, mixture: tuple) -> None: ...

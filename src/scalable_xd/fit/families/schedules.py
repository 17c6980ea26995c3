"""Step-size schedules of the minibatch methods, as pure functions of where the fit is."""

from __future__ import annotations


def step_decay(base: float, decay: float, decay_epoch: int, epoch: int) -> float:
    """``base``, multiplied by ``decay`` from epoch ``decay_epoch`` (0-based) on: the paper's schedule (minibatch
    EM 1e-2 halved after 10 epochs; SGD's learning rate 1e-2 then 1e-3)."""
    return base * (decay if epoch >= decay_epoch else 1.0)


def cappe_moulines(base: float, kappa: float, n_updates: int) -> float:
    """lambda_t = (t0 + t)^-kappa after t updates, t0 = base^(-1/kappa) so that it starts at ``base``
    (Cappe & Moulines 2009 recommend kappa in (0.5, 1])."""
    t0 = base ** (-1.0 / kappa)
    return (t0 + n_updates) ** (-kappa)


def power(base: float, kappa: float, n_updates: int) -> float:
    """gamma_r = base r^-kappa for update r = n_updates + 1 (Nguyen, Forbes & McLachlan 2020)."""
    return base * (n_updates + 1) ** (-kappa)

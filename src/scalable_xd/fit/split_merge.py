"""Split-and-merge EM (Ueda et al. 2000, as Bovy, Hogg & Roweis 2011 apply it to XD) for batch EM.

EM runs to convergence; then the components are ranked for a move: merge candidates (j, k) by the overlap
of their responsibilities, sum_i r_ij r_ik, and split candidates l by the local Kullback-Leibler divergence
of the stars component l claims from the component itself (``Criteria``). A move merges j and k into
one component (moment-matched) and splits l into two, then runs partial EM on those three with every
other component fixed (``FixedParameters``), then full EM to convergence. The move is kept only when the
converged training log-likelihood beats the one before the move; otherwise the fit returns to the
parameters before it and tries the next candidate, until ``tries`` moves have been tried. The sums the
criteria need come from the same statistics pass as EM's (``batch_statistics(with_criteria=True)``).

The split keeps the component's first two moments: the halves sit at m +- delta along the principal axis
(delta = sqrt(lambda_1) v_1 / 2) with covariance V - delta delta^T, so their mixture has mean m and
covariance V. (Ueda et al. and Bovy's code restart both halves from det(V)^(1/D) I with random offsets,
which mixes the features' units, degrees and milliarcseconds alike.)
"""

from __future__ import annotations

import torch

from ..kernel.statistics import Criteria, Statistics
from ..mixture import Mixture
from .updates import FixedParameters, em_update

# Partial-EM iterations on the three moved components before full EM resumes.
PARTIAL_EPOCHS = 5


def split_scores(criteria: Criteria, q: torch.Tensor) -> torch.Tensor:
    """Local KL divergence of each component's stars from the component, sum_i f_ij log(f_ij / N_ij) with
    f_ij = r_ij / q_j; -inf for components that claim no star (nothing to split)."""
    live = q > torch.finfo(q.dtype).tiny
    q_safe = torch.where(live, q, torch.ones_like(q))
    score = (criteria.r_log_r - criteria.r_log_n) / q_safe - torch.log(q_safe)
    return torch.where(live, score, torch.full_like(score, -torch.inf))


def ranked_moves(criteria: Criteria, q: torch.Tensor, limit: int) -> list[tuple[int, int, int]]:
    """Up to ``limit`` (j, k, l) moves: merge pairs by decreasing overlap, and for each the split candidates
    other than j and k by decreasing local divergence (Ueda et al.'s order, as in Bovy's code)."""
    k = len(q)
    if k < 3:
        return []
    overlap = criteria.overlap.clone()
    rows, cols = torch.triu_indices(k, k, offset=1)
    pairs = sorted(zip(overlap[rows, cols].tolist(), rows.tolist(), cols.tolist()), reverse=True)
    splits = split_scores(criteria, q)
    order = torch.argsort(splits, descending=True).tolist()
    moves = []
    for _, j, m in pairs:
        for l in order:  # noqa: E741 (Ueda et al.'s name)
            if l not in (j, m) and torch.isfinite(splits[l]):
                moves.append((j, m, l))
                if len(moves) == limit:
                    return moves
    return moves


def apply_move(mixture: Mixture, q: torch.Tensor, move: tuple[int, int, int]) -> Mixture:
    """Merge j and k into j (weights added, means and covariances moment-matched with weights q) and split
    l into l and k along its principal axis (see the module docstring)."""
    j, k, l = move  # noqa: E741
    weights, means, covs = mixture.weights.clone(), mixture.means.clone(), mixture.covariances.clone()
    qj, qk = (float(q[j]), float(q[k])) if float(q[j] + q[k]) > 0 else (1.0, 1.0)
    share_j, share_k = qj / (qj + qk), qk / (qj + qk)
    merged_mean = share_j * means[j] + share_k * means[k]
    dj, dk = means[j] - merged_mean, means[k] - merged_mean
    merged_cov = share_j * (covs[j] + torch.outer(dj, dj)) + share_k * (covs[k] + torch.outer(dk, dk))
    eigenvalues, eigenvectors = torch.linalg.eigh(covs[l])
    delta = 0.5 * torch.sqrt(eigenvalues[-1]) * eigenvectors[:, -1]
    half_cov = covs[l] - torch.outer(delta, delta)
    weights[j], weights[k], weights[l] = weights[j] + weights[k], weights[l] / 2, weights[l] / 2
    means[j], means[k], means[l] = merged_mean, means[l] + delta, means[l] - delta
    covs[j], covs[k], covs[l] = 0.5 * (merged_cov + merged_cov.mT), half_cov, half_cov
    return Mixture(weights, means, covs)


def others_fixed(mixture: Mixture, move: tuple[int, int, int]) -> FixedParameters:
    """Every component but the move's three held, for partial EM (their weights share what is left)."""
    fixed = torch.ones(mixture.n_components, dtype=torch.bool, device=mixture.means.device)
    fixed[list(move)] = False
    return FixedParameters(fixed, fixed, fixed, mixture.weights)


class SplitMergeEM:
    """Batch EM with split-and-merge moves (the module docstring); ``tol`` decides convergence (per star),
    ``tries`` caps the moves tried. ``finished`` tells the loop that no move is left to try."""

    samples_assignments = False
    wants_criteria = True

    def __init__(self, mixture: Mixture, *, w: float, tol: float, tries: int, fixed: FixedParameters | None = None):
        if fixed is not None and fixed.any():
            raise ValueError("split_merge moves components, so it cannot keep fixed parameters")
        self.mixture = mixture
        self.w, self.tol, self.tries = w, tol, tries
        self.phase = "em"  # em -> (partial -> full)* -> done
        self.previous: float | None = None  # mean log-likelihood of the last epoch's E-step model
        self.incumbent: Mixture | None = None  # the best converged parameters so far, and their score
        self.incumbent_loglik = -float("inf")
        self.incumbent_q: torch.Tensor | None = None
        self.moves: list = []  # candidates ranked at the incumbent
        self.move: tuple | None = None
        self.partial_left = 0
        self.tried = self.accepted = 0
        self._sums: Statistics | None = None

    @property
    def finished(self) -> bool:
        return self.phase == "done"

    @property
    def result(self) -> Mixture:
        """The incumbent while a move is being judged (its score is known), otherwise the current model."""
        return self.incumbent if self.phase in ("partial", "full") else self.mixture

    def step_size(self, epoch: int) -> float:
        return 1.0

    def start_epoch(self, epoch: int) -> None:
        self._sums = None

    def observe(self, stats: Statistics) -> None:
        self._sums = stats.double() if self._sums is None else self._sums.combine(stats.double())

    def end_epoch(self) -> None:
        sums, self._sums = self._sums, None
        if self.phase == "done":
            return
        loglik = float(sums.loglik) / sums.n_points  # of self.mixture, the E-step's model
        if self.phase == "partial":
            self.mixture = em_update(self.mixture, sums, self.w, others_fixed(self.mixture, self.move))
            self.partial_left -= 1
            if self.partial_left == 0:
                self.phase, self.previous = "full", None
            return
        if self.previous is not None and loglik - self.previous < self.tol:
            self._converged(loglik, sums)
            return
        self.previous = loglik
        self.mixture = em_update(self.mixture, sums, self.w)

    def _converged(self, loglik: float, sums: Statistics) -> None:
        """EM (or a move's full EM) converged at ``self.mixture``: judge the move, then try the next one."""
        if self.phase == "full":
            self.tried += 1
        if self.phase == "em" or loglik > self.incumbent_loglik:
            self.accepted += self.phase == "full"
            self.incumbent, self.incumbent_loglik, self.incumbent_q = self.mixture, loglik, sums.q
            self.moves = ranked_moves(sums.criteria, sums.q, self.tries - self.tried)
        if self.tried >= self.tries or not self.moves:
            self.phase, self.mixture = "done", self.incumbent
            return
        self.move = self.moves.pop(0)
        self.mixture = apply_move(self.incumbent, self.incumbent_q, self.move)
        self.phase, self.partial_left, self.previous = "partial", PARTIAL_EPOCHS, None

    def diagnostics(self) -> dict:
        return {"moves_tried": self.tried, "moves_accepted": self.accepted}

    def state_dict(self) -> dict:
        from .fitters import _mixture_state

        none = {"weights": torch.zeros(0), "means": torch.zeros(0), "covariances": torch.zeros(0)}
        return {
            "mixture": _mixture_state(self.mixture), "phase": self.phase, "previous": self.previous,
            "incumbent": none if self.incumbent is None else _mixture_state(self.incumbent),
            "incumbent_loglik": self.incumbent_loglik,
            "incumbent_q": torch.zeros(0) if self.incumbent_q is None else self.incumbent_q,
            "moves": [list(m) for m in self.moves], "move": None if self.move is None else list(self.move),
            "partial_left": self.partial_left, "tried": self.tried, "accepted": self.accepted,
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        from .fitters import _mixture_from_state

        self.mixture = _mixture_from_state(state["mixture"], self.mixture)
        self.phase, self.previous = state["phase"], state["previous"]
        has_incumbent = state["incumbent"]["means"].numel() > 0
        self.incumbent = _mixture_from_state(state["incumbent"], self.mixture) if has_incumbent else None
        self.incumbent_loglik = float(state["incumbent_loglik"])
        self.incumbent_q = state["incumbent_q"].to(self.mixture.means) if has_incumbent else None
        self.moves = [tuple(m) for m in state["moves"]]
        self.move = None if state["move"] is None else tuple(state["move"])
        self.partial_left, self.tried, self.accepted = (int(state[k]) for k in ("partial_left", "tried", "accepted"))

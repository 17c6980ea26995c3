"""Split-and-merge (Ueda et al. 2000, as Bovy, Hogg & Roweis 2011 apply it to XD): for batch EM, and a
stochastic form for the minibatch methods (``StochasticSplitMerge``; design and reasoning in
docs/design/split-merge.md).

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

import math
from collections.abc import Callable

import torch

from ...kernel.statistics import Criteria, Statistics
from ...mixture import Mixture
from ..fitters import Capabilities, TrialFitter, mixture_from_state, mixture_state
from ..rules.em import FixedParameters, em_update, ridge_vector
from .batch_em import EpochSums

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
    rows, cols = torch.triu_indices(k, k, offset=1)
    pairs = sorted(zip(criteria.overlap[rows, cols].tolist(), rows.tolist(), cols.tolist()), reverse=True)
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


class SplitMergeEM(EpochSums):
    """Batch EM with split-and-merge moves (the module docstring); ``tol`` decides convergence (per star),
    ``tries`` caps the moves tried. ``finished`` tells the loop that no move is left to try."""

    def __init__(
        self,
        mixture: Mixture,
        *,
        w: float | torch.Tensor | None,
        tol: float,
        tries: int,
    ):
        self.mixture = mixture
        self.w, self.tol, self.tries = ridge_vector(w, mixture.means), tol, tries
        self.phase = "em"  # em -> (partial -> full)* -> done
        self.previous: float | None = None  # mean log-likelihood of the last epoch's E-step model
        self.incumbent: Mixture | None = None  # the best converged parameters so far, and their score
        self.incumbent_loglik = -float("inf")
        self.trial_loglik = -float("inf")  # of the trial's last E-step model
        self.incumbent_q: torch.Tensor | None = None
        self.moves: list = []  # candidates ranked at the incumbent
        self.move: tuple | None = None
        self.partial_left = 0
        self.tried = self.accepted = 0
        self._wants_criteria = False  # asked for once EM has converged (see ``end_epoch``)

    @property
    def finished(self) -> bool:
        return self.phase == "done"

    @property
    def result(self) -> Mixture:
        """While a move is being tried: the incumbent, or the trial once its log-likelihood (at its last
        E-step; EM and partial EM only raise it) beats the incumbent's, so that a fit whose epochs run out
        mid-trial reports the better of the two. Otherwise the current model."""
        if self.phase in ("partial", "full") and self.trial_loglik <= self.incumbent_loglik:
            return self._incumbent()[0]
        return self.mixture

    def _incumbent(self) -> tuple[Mixture, torch.Tensor]:
        """The incumbent and its q, which exist once EM first converged (every phase after "em")."""
        if self.incumbent is None or self.incumbent_q is None:
            raise RuntimeError(f"split_merge in phase {self.phase!r} has no incumbent")
        return self.incumbent, self.incumbent_q

    def end_epoch(self) -> None:
        sums, self._sums = self._sums, None
        if self.phase == "done":
            return
        if sums is None or sums.loglik is None:
            raise RuntimeError("split_merge's epoch ended without statistics (or their log-likelihood)")
        loglik = float(sums.loglik) / float(sums.n_points)  # of self.mixture, the E-step's model
        if self.phase in ("partial", "full"):
            self.trial_loglik = loglik
        if self.phase == "partial":
            if self.move is None:
                raise RuntimeError("split_merge's partial phase has no move")
            self.mixture = em_update(self.mixture, sums, self.w, others_fixed(self.mixture, self.move))
            self.partial_left -= 1
            if self.partial_left == 0:
                self.phase, self.previous = "full", None
            return
        if self.previous is not None and loglik - self.previous < self.tol:
            if sums.criteria is None:  # the criteria cost K^2 per star: computed only at convergence, so
                self._wants_criteria = True  # the next epoch's pass repeats this one's at the same parameters
                return
            self._wants_criteria = False
            self._converged(loglik, sums.q, sums.criteria)
            return
        self.previous = loglik
        self.mixture = em_update(self.mixture, sums, self.w)

    def _converged(self, loglik: float, q: torch.Tensor, criteria: Criteria) -> None:
        """EM (or a move's full EM) converged at ``self.mixture``, where the responsibilities sum to ``q``
        and the criteria's sums are ``criteria``: judge the move, then try the next one."""
        if self.phase == "full":
            self.tried += 1
        if self.phase == "em" or loglik > self.incumbent_loglik:
            self.accepted += self.phase == "full"
            self.incumbent, self.incumbent_loglik, self.incumbent_q = self.mixture, loglik, q
            self.moves = ranked_moves(criteria, q, self.tries - self.tried)
        incumbent, incumbent_q = self._incumbent()
        if self.tried >= self.tries or not self.moves:
            self.phase, self.mixture = "done", incumbent
            return
        self.move = self.moves.pop(0)
        self.mixture = apply_move(incumbent, incumbent_q, self.move)
        self.phase, self.partial_left, self.previous = "partial", PARTIAL_EPOCHS, None
        self.trial_loglik = -float("inf")

    def diagnostics(self) -> dict:
        return {"moves_tried": self.tried, "moves_accepted": self.accepted}

    def state_dict(self) -> dict:
        none = {"weights": torch.zeros(0), "means": torch.zeros(0), "covariances": torch.zeros(0)}
        return {
            "mixture": mixture_state(self.mixture),
            "phase": self.phase,
            "previous": self.previous,
            "incumbent": none if self.incumbent is None else mixture_state(self.incumbent),
            "incumbent_loglik": self.incumbent_loglik,
            "trial_loglik": self.trial_loglik,
            "incumbent_q": torch.zeros(0) if self.incumbent_q is None else self.incumbent_q,
            "moves": [list(m) for m in self.moves],
            "move": None if self.move is None else list(self.move),
            "partial_left": self.partial_left,
            "tried": self.tried,
            "accepted": self.accepted,
            "wants_criteria": self.wants_criteria,
        }

    def load_state_dict(self, state: dict) -> None:
        self.mixture = mixture_from_state(state["mixture"], self.mixture)
        self.phase, self.previous = state["phase"], state["previous"]
        has_incumbent = state["incumbent"]["means"].numel() > 0
        self.incumbent = mixture_from_state(state["incumbent"], self.mixture) if has_incumbent else None
        self.incumbent_loglik = float(state["incumbent_loglik"])
        self.trial_loglik = float(state["trial_loglik"])
        self.incumbent_q = state["incumbent_q"].to(self.mixture.means) if has_incumbent else None
        self.moves = [tuple(m) for m in state["moves"]]
        self.move = None if state["move"] is None else tuple(state["move"])
        self.partial_left, self.tried, self.accepted = (int(state[k]) for k in ("partial_left", "tried", "accepted"))
        self._wants_criteria = bool(state["wants_criteria"])


class StochasticSplitMerge(Capabilities):
    """Split-and-merge for minibatch EM and SGD without full passes (docs/design/split-merge.md).

    * Criteria: the ``Criteria`` sums of every batch of an epoch, each at the parameters of its update, added
      up over the epoch: every star enters once, so they estimate the full-data criteria up to the drift of
      the parameters within the epoch.
    * A move is proposed at the end of an epoch (from that epoch's sums) while ``tries`` remain and no
      trial is running. The trial is a second fitter (``make_fitter``) started from the moved incumbent;
      through the next epoch it takes the same batches as the incumbent, each with its own statistics
      pass (the loop's ``trial_mixture``), the first ``partial_batches`` of them with every other component
      fixed (a partial update), the rest freely.
    * At the end of that epoch both are scored on the same fixed validation sample (``judge``), and the
      trial replaces the incumbent only if it scores higher. A trial epoch costs two statistics passes
      per batch; every other epoch costs the criteria's K x K overlap sums on top of the usual pass.
    """

    def __init__(
        self,
        incumbent: TrialFitter,
        *,
        make_fitter: Callable[[Mixture, FixedParameters], TrialFitter],
        judge: Callable[[Mixture], float],
        tries: int,
        partial_fraction: float = 0.1,
    ):
        self.incumbent, self.make_fitter, self.judge = incumbent, make_fitter, judge
        self._samples_assignments = incumbent.samples_assignments
        self.tries, self.partial_fraction = tries, partial_fraction
        self.trial: TrialFitter | None = None
        self.move: tuple | None = None
        self.partial_left = 0
        self.tried = self.accepted = 0
        self.last_scores: tuple[float, float] | None = None
        self._criteria: Criteria | None = None
        self._q: torch.Tensor | None = None
        self._batches = 0
        self._epoch = 0

    @property
    def mixture(self) -> Mixture:
        return self.incumbent.mixture

    @property
    def result(self) -> Mixture:
        return self.incumbent.result

    @property
    def wants_criteria(self) -> bool:
        """Only epochs that may end with a proposal need the criteria (not a trial's epoch), and only while
        tries remain."""
        return self.trial is None and self.tried < self.tries

    @property
    def trial_mixture(self) -> Mixture | None:
        """The trial's E-step model while a move is being tried: the loop gives it its own statistics."""
        return None if self.trial is None else self.trial.mixture

    def step_size(self, epoch: int) -> float:
        return self.incumbent.step_size(epoch)

    def start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._criteria, self._q, self._batches = None, None, 0
        self.incumbent.start_epoch(epoch)
        if self.trial is not None:
            self.trial.start_epoch(epoch)

    def observe(self, stats: Statistics) -> None:
        self.incumbent.observe(stats)
        stats = stats.double()
        if stats.criteria is not None:
            self._criteria = stats.criteria if self._criteria is None else self._criteria.combine(stats.criteria)
            self._q = stats.q if self._q is None else self._q + stats.q
        self._batches += 1

    def observe_trial(self, stats: Statistics) -> None:
        """The trial's update from its own statistics of the same batch (partial for the first batches)."""
        if self.trial is None:
            raise RuntimeError("a trial's statistics came while no move is being tried")
        self.trial.observe(stats)
        self.partial_left -= 1
        if self.partial_left == 0:
            self.trial.release_fixed()

    def end_epoch(self) -> None:
        self.incumbent.end_epoch()
        if self.trial is not None:
            self.trial.end_epoch()
            self.tried += 1
            scores = self.judge(self.incumbent.result), self.judge(self.trial.result)
            self.last_scores = scores
            if scores[1] > scores[0]:
                self.incumbent, self.accepted = self.trial, self.accepted + 1
            self.trial = None
            return  # the next move is ranked from an epoch of the kept model's own criteria
        if self.tried < self.tries and self._criteria is not None and self._q is not None:
            moves = ranked_moves(self._criteria, self._q, 1)
            if moves:
                self._start_trial(moves[0], self._q)

    def _start_trial(self, move: tuple[int, int, int], q: torch.Tensor) -> None:
        moved = apply_move(self.incumbent.starting_point, q, move)
        trial = self.make_fitter(moved, others_fixed(moved, move))
        trial.continue_schedule(self.incumbent)
        trial.start_epoch(self._epoch + 1)
        self.trial = trial
        self.move = move
        self.partial_left = max(1, math.ceil(self.partial_fraction * self._batches))

    def diagnostics(self) -> dict:
        scores = {} if self.last_scores is None else {"last_judged": list(self.last_scores)}
        return {"moves_tried": self.tried, "moves_accepted": self.accepted, **scores}

    def state_dict(self) -> dict:
        """Checkpoints are written after ``end_epoch``: a trial then has just been proposed and has taken no
        batch yet, so the move and the q it was built with recreate it exactly."""
        pending = self.trial is not None and self.move is not None
        return {
            "incumbent": self.incumbent.state_dict(),
            "tried": self.tried,
            "accepted": self.accepted,
            "last_scores": None if self.last_scores is None else list(self.last_scores),
            "move": list(self.move) if pending and self.move is not None else None,
            "q": self._q if pending else torch.zeros(0),
            "batches": self._batches,
            "epoch": self._epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        self.incumbent.load_state_dict(state["incumbent"])
        self.tried, self.accepted = int(state["tried"]), int(state["accepted"])
        self.last_scores = None if state["last_scores"] is None else tuple(state["last_scores"])
        self._batches, self._epoch = int(state["batches"]), int(state["epoch"])
        self.trial = None
        if state["move"] is not None:
            self._q = state["q"].to(self.incumbent.mixture.means)
            self._start_trial(tuple(state["move"]), self._q)

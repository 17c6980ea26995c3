"""The epoch loop shared by every fitter: batching, timing, evaluation, checkpoints and divergence checks.

History entry 0 describes the initial parameters; entry e the parameters after epoch e. ``seconds`` is the
cumulative training wall time (batch transfer, statistics and updates) and ``cpu_seconds`` the process CPU
time it took over all threads (which another program on a shared machine moves less), both excluding the
evaluation passes that fill ``train_loglik`` and ``val_loglik`` (mean log-likelihood per point: over the
whole validation set, and over the training set or, for the minibatch methods, a fixed sample of it,
``train_score_rows``).

Batch EM needs no evaluation pass over the training set: its E-step of epoch e + 1 sums the log-likelihood
of the parameters after epoch e over every training point, which is entry e's ``train_loglik``. So each
iteration is one pass; entry e's figure is filled when the next pass is done, and one pass after the last
update scores the final parameters. Convergence (an improvement below ``tol``) is found by the pass that
scores the parameters, after which no update is made: the fit stops at the parameters it scored, as when
a separate evaluation pass found it. Validation data are still scored by their own pass.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import sys
import time

import torch
from tqdm.auto import tqdm

from .. import deferred_checks
from .._torch import one_thread, synchronize
from ..data.batching import generator
from ..data.source import DataSource
from ..errors import FitDivergedError, NotPositiveDefiniteError
from ..kernel.fused import PARALLEL_PAIRS
from ..mixture import Mixture
from .engines import Engine, engine_for
from .families.background_fit import background_of
from .fitters import Fitter
from .rules.sgd import feature_scale
from .run.checkpoint import Checkpoint, CheckpointError, check_state, tensor_shapes
from .run.loop_config import LoopConfig
from .run.parallel import reduce_sum
from .run.scoring import ScoreRequest, shares_scoring, total_loglik

log = logging.getLogger("scalable_xd.fit")
# A component's variance along a feature, in units of the data's variance there, below which it has collapsed
# (``_check_collapse``): float64's resolution, beyond which no data set resolves a width
COLLAPSED = float(torch.finfo(torch.float64).eps)
EPOCH_LINES = 50  # a fit's epoch lines at most (and its last): a small data set's minibatch fit runs hundreds


def assignment_uniforms(seed: int, epoch: int, batch: int, size: int, device, dtype) -> torch.Tensor:
    """Stochastic EM's uniforms for one batch: drawn on the CPU from a generator that depends only on
    (seed, epoch, batch), so that draws are the same on every device and after a resume."""
    uniforms = torch.rand(size, generator=generator(seed, epoch, batch, 1), dtype=torch.float64)
    return uniforms.to(device=device, dtype=dtype, non_blocking=True)


def _check_mixture(mixture: Mixture, epoch: int, cures: str) -> None:
    problem = mixture.first_invalid_component()
    if problem is not None:
        raise FitDivergedError(epoch, problem[0], problem[1], cures)


def _check_collapse(mixture: Mixture, spread: torch.Tensor, noise_free: torch.Tensor | None, epoch: int, cures: str):
    """A component whose variance along some feature, given the features before it (its Cholesky pivot), fell
    below ``COLLAPSED`` of that feature's variance in the data (``spread`` squared), in a feature some star
    measures without noise (``noise_free``, (D,) bool; None: not known, nothing checked), raises the fit's
    divergence: on a few repeated points measured without noise the likelihood grows without bound as the
    component narrows, and where batch EM's covariance turns singular at once, minibatch EM's shrinks by its
    step each update and SGD's log-Cholesky factors approach 0, every step still positive definite (5e-36 and
    1e-73 were returned without a word). Where every star's noise widens it, a variance of 0 is XD's bounded
    optimum for a component narrower than the noise, not a divergence."""
    if noise_free is None or not noise_free.any():
        return
    unit = mixture.covariances / (spread[:, None] * spread[None, :])
    pivots = torch.diagonal(torch.linalg.cholesky_ex(unit)[0], dim1=-2, dim2=-1) ** 2
    shrunk = (pivots < COLLAPSED) & noise_free
    if shrunk.any():
        component, feature = (int(i) for i in torch.nonzero(shrunk)[0])
        reason = (
            f"collapsed: its variance along feature {feature} (given the features before it) fell to "
            f"{float(pivots[component, feature]):.3g} of the data's variance in that feature, below float64's "
            f"resolution ({COLLAPSED:.2g}), as a component does on a few repeated points without regularisation"
        )
        raise FitDivergedError(epoch, component, reason, cures)


@contextlib.contextmanager
def _factorisation_fails_as_divergence(epoch: int, cures: str):
    """A pass that cannot factorise some V_j + S_i once the fit has updated V_j reported as the fit's
    divergence (``FitDivergedError``, with its cures), as a covariance the validity check refuses is: V_j
    has turned singular to working precision where a star's noise does not widen it."""
    try:
        yield
    except NotPositiveDefiniteError as err:
        reason = (
            "has a covariance singular to working precision: V_j + S_i does not factorise for a star whose noise "
            "does not widen it"
        )
        raise FitDivergedError(epoch, err.component, reason, cures) from err


def _log(cfg: LoopConfig, entry: dict, last: bool = False) -> None:
    """A line for the epoch on the ``scalable_xd.fit`` logger (when ``verbose``), so applications route it:
    every epoch's up to ``EPOCH_LINES`` epochs, else every k-th (k the least that gives at most that many),
    and the ``last``; where nothing configured logging at all, a stderr handler is added so that verbose
    output shows."""
    if cfg.verbose < 1 or not (last or _has_a_line(cfg, entry["epoch"])):
        return
    if not logging.getLogger().hasHandlers() and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[scalable-xd] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    val = "" if entry["val_loglik"] is None else f"  val {entry['val_loglik']:.5f}"
    log.info(
        "epoch %3d/%d  %9.2f s  train %.5f%s", entry["epoch"], cfg.epochs, entry["seconds"], entry["train_loglik"], val
    )


def run(
    fitter: Fitter,
    train: DataSource,
    val: DataSource | None,
    cfg: LoopConfig,
    checkpoint: Checkpoint | None = None,
    monitored: dict[str, DataSource] | None = None,
    scored: DataSource | None = None,
):
    """Fit until ``cfg.epochs`` epochs are done (or batch EM converges), continuing from the checkpoint's
    saved state when there is one and saving to it after every epoch (and every ``cfg.checkpoint_every``
    batches); returns (history, converged). ``monitored`` ({name: data}) are scored after every epoch as
    ``val`` is, into each entry's ``<name>_loglik``; ``scored`` (default ``train``) is what an evaluation pass
    scores for ``train_loglik`` (a fixed sample of ``train``: the ``train_score_rows`` setting).

    A checkpoint written inside an epoch records the batches done; a resumed fit runs the same epoch's
    batches from there (the data source serves that epoch's batches again, skipping those done: a streamed
    source reads the windows before them again, computing nothing), so it ends as an uninterrupted fit.

    Where every pass of the fit (training, scoring, validation) is below ``PARALLEL_PAIRS`` pairs, the
    whole fit runs on one torch thread: the passes run serially then anyway, and a pool's wake-ups after
    each small parameter-side operation (a K-matrix Cholesky) cost more than the operation."""
    data = [train, val, scored, *(monitored or {}).values()]
    with one_thread(_small_fit(cfg, fitter, max(len(d) for d in data if d is not None))):
        return _run(fitter, train, val, cfg, checkpoint, monitored, scored)


def _run(fitter: Fitter, train, val, cfg: LoopConfig, checkpoint, monitored, scored):
    """``run``'s loop."""
    one_pass = fitter.scores_its_pass
    scored_data = train if scored is None or one_pass else scored
    evaluate = functools.partial(_entry, fitter, cfg, scored_data, val, monitored or {})
    store = checkpoint if checkpoint is not None and cfg.group.writes else None  # what this process saves to
    start, history, converged, done, done_seconds, resumed = _starting_point(fitter, cfg, checkpoint, evaluate)
    epoch = start + 1
    engine = engine_for(fitter, cfg)
    spread = feature_scale(fitter.result)  # the data's, under the start: what a collapse is measured against
    least = cfg.least_noise
    noise_free = None if least is None else least.to(spread) < COLLAPSED * spread**2
    while epoch <= cfg.epochs and not converged:
        synchronize(cfg.device)
        tick = _now()
        fitter.start_epoch(epoch - 1)
        if done:  # start_epoch cleared what the checkpoint holds of this epoch (batch EM's sums so far)
            fitter.load_state_dict(resumed)
        train_epoch = functools.partial(
            _train_epoch, fitter, train, cfg, epoch, done, done_seconds, tick, store, history, engine
        )
        with one_thread(_small_steps(cfg, fitter)), _factorisation_fails_as_divergence(epoch, cfg.cures):
            if cfg.defer_checks and not cfg.checkpoint_every:
                _train_epoch_deferred(fitter, train_epoch, cfg, epoch, converged, engine)
            else:
                train_epoch(converged)
        synchronize(cfg.device)
        seconds = _clock(history[-1], done_seconds, tick)
        done, done_seconds = 0, (0.0, 0.0)
        if one_pass and _scored_by_its_pass(fitter, train, cfg, history):
            converged = True  # at the parameters just scored: no update from this pass
            break
        fitter.end_epoch()
        _check_mixture(fitter.mixture, epoch, cfg.cures)
        _check_mixture(fitter.result, epoch, cfg.cures)
        _check_collapse(fitter.result, spread, noise_free, epoch, cfg.cures)
        with _factorisation_fails_as_divergence(epoch, cfg.cures):
            history.append(evaluate(epoch, *seconds, score_train=not one_pass))
        if not one_pass:
            _log(cfg, history[-1])
            converged = improved_less_than(cfg.tol, history)
        converged = converged or fitter.finished
        if store is not None:
            store.save(epoch, history, converged, fitter.state_dict())
        epoch += 1
    if history[-1]["train_loglik"] is None:  # batch EM stopped by its epoch budget: score the last update
        history[-1]["train_loglik"] = _mean_loglik(train, fitter, cfg)
        _log(cfg, history[-1], last=True)
    elif not _has_a_line(cfg, history[-1]["epoch"]):
        _log(cfg, history[-1], last=True)
    return history, converged


def _has_a_line(cfg: LoopConfig, epoch: int) -> bool:
    """Whether the epoch's entry is logged as it is made (``_log``)."""
    return epoch % max(1, -(-cfg.epochs // EPOCH_LINES)) == 0 or epoch == cfg.epochs


def _now() -> tuple[float, float]:
    """The (wall, process CPU) clocks the loop times training by."""
    return time.perf_counter(), time.process_time()


def _elapsed(done_seconds: tuple[float, float], tick: tuple[float, float]) -> list[float]:
    """The epoch's (wall, CPU) seconds so far: the ``done_seconds`` of its batches done before a resume and
    the time since ``tick`` (``_now``)."""
    return [done + now - then for done, now, then in zip(done_seconds, _now(), tick)]


def _clock(last: dict, done_seconds: tuple[float, float], tick: tuple[float, float]) -> tuple[float, float]:
    """Cumulative training (wall, CPU) seconds: ``last`` entry's and the epoch's (``_elapsed``)."""
    wall, cpu = _elapsed(done_seconds, tick)
    return last["seconds"] + wall, last.get("cpu_seconds", 0.0) + cpu


def _entry(
    fitter: Fitter,
    cfg: LoopConfig,
    scored,
    val,
    monitored: dict,
    epoch: int,
    seconds: float,
    cpu_seconds: float,
    score_train: bool,
):
    """A history entry for the fitter's current result; its training figure left to the next pass
    (``score_train`` False: batch EM, whose E-step computes it)."""
    return {
        "epoch": epoch,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "train_loglik": _mean_loglik(scored, fitter, cfg) if score_train else None,
        "val_loglik": None if val is None else _mean_loglik(val, fitter, cfg),
        **{f"{name}_loglik": _mean_loglik(data, fitter, cfg) for name, data in monitored.items()},
        "step_size": fitter.step_size(max(epoch - 1, 0)),
        **fitter.diagnostics(),
    }


def _starting_point(fitter: Fitter, cfg: LoopConfig, checkpoint: Checkpoint | None, evaluate) -> tuple:
    """(epochs done, history, converged, batches of the epoch in progress done and their seconds, the
    fitter's state then): the checkpoint's, loaded into the fitter, or a fresh fit's."""
    if checkpoint is not None and checkpoint.saved is not None:
        saved, path = checkpoint.saved, checkpoint.path
        resume_state(fitter, saved["fitter"], f"checkpoint {path}", f"delete {path} to start the fit afresh")
        done = (saved["batch"], tuple(saved["epoch_seconds"]), saved["fitter"])
        return (saved["epoch"], saved["history"], saved["converged"], *done)
    one_pass = fitter.scores_its_pass
    history = [evaluate(0, 0.0, 0.0, score_train=not one_pass)]
    if not one_pass:
        _log(cfg, history[0])
    return 0, history, False, 0, (0.0, 0.0), {}


def _scored_by_its_pass(fitter: Fitter, train: DataSource, cfg: LoopConfig, history: list) -> bool:
    """Fill the last entry's training figures from the epoch's pass, which scored the parameters it
    started from (batch EM); whether they improved by less than ``tol``."""
    history[-1]["train_loglik"] = fitter.pass_loglik() / train.total_weight
    objective = fitter.pass_objective()
    if objective is not None:
        history[-1]["train_objective"] = objective / train.total_weight
    _log(cfg, history[-1])
    return improved_less_than(cfg.tol, history)


def resume_state(fitter: Fitter, state: dict, what: str, advice: str) -> None:
    """Load a saved fitter state (a checkpoint's, a model file's running state), refusing
    (``CheckpointError``: ``what`` holds ...; ``advice``) one that does not fit this fitter or is not a valid
    fit (``checkpoint.check_state``), instead of resuming a wrong model."""
    expected = tensor_shapes(fitter.state_dict())  # this fit's own state, built for its K and D
    try:
        fitter.load_state_dict(state)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(
            f"{what} holds a state this fit cannot take ({err.__class__.__name__}: {str(err)[:120]}); {advice}"
        ) from None
    check_state(fitter, expected, what, advice)


def _small_fit(cfg: LoopConfig, fitter: Fitter, rows: int) -> bool:
    """Whether every pass over ``rows`` points (the most any pass scores) is too small for more than one
    CPU thread (``kernel.fused``); never in lockstep, whose passes are the fits' together (and torch's
    thread count is every fit's to share)."""
    small = rows * fitter.mixture.n_components < PARALLEL_PAIRS
    return cfg.device.type == "cpu" and small and cfg.lockstep is None


def _small_steps(cfg: LoopConfig, fitter: Fitter) -> bool:
    """Whether an epoch is minibatch steps too small for more than one CPU thread (``kernel.fused``); never
    in lockstep, whose steps are the fits' together (and torch's thread count is every fit's to share)."""
    return cfg.shuffle and _small_fit(cfg, fitter, cfg.batch_size)


def _train_epoch_deferred(
    fitter: Fitter, train_epoch, cfg: LoopConfig, epoch: int, converged: bool, engine: Engine
) -> None:
    """``train_epoch`` with the per-batch tests deferred to its end (``deferred_checks``; to the engine's
    flag where it has one); where one tripped, the epoch again from the fitter's state at its start,
    testing at every batch."""
    start = copy.deepcopy(fitter.state_dict())
    with deferred_checks.deferring(cfg.device, engine.checks) as checks:
        train_epoch(converged)
    if reduce_sum(float(checks.tripped()), cfg.group, cfg.device) > 0:  # tripped in any process
        log.debug("epoch %d: a deferred check tripped, so the epoch runs again testing at every batch", epoch)
        fitter.start_epoch(epoch - 1)
        fitter.load_state_dict(start)
        engine.restart()
        train_epoch(converged)


def improved_less_than(tol: float | None, history: list) -> bool:
    """Whether the last entry's training log-likelihood is less than ``tol`` above the one before; judged
    only where the last entry's model is one update from the one before (``em_step``: see ``squarem``)."""
    if tol is None or not history[-1].get("em_step", True):
        return False
    gain = last_gain(history)
    return gain is not None and gain < tol


def last_gain(history: list) -> float | None:
    """The gain of the last entry that is one update from the entry before it (``em_step``), or None where
    there is none: in the fitter's objective where both entries record one, else in mean log-likelihood."""
    for before, after in zip(reversed(history[:-1]), reversed(history[1:])):
        if after.get("em_step", True):
            key = "train_objective" if "train_objective" in before and "train_objective" in after else "train_loglik"
            return after[key] - before[key]
    return None


def _mean_loglik(data: DataSource, fitter: Fitter, cfg: LoopConfig) -> float:
    """The mean log-likelihood of ``data`` under the fitter's result (and its background, where it has one);
    in lockstep on CUDA, in one pass with the other fits' scorings of the same data (``scoring``)."""
    background = background_of(fitter)
    if cfg.lockstep is not None and background is None and not cfg.group.parallel and shares_scoring(cfg.device):
        request = ScoreRequest(data, fitter.result, cfg.device, cfg.dtype, cfg.backend)
        cfg.lockstep.step(request)
        return request.total / data.total_weight
    total = total_loglik(data, fitter.result, cfg.device, cfg.dtype, cfg.backend, cfg.group, background)
    return total / data.total_weight


def _train_epoch(
    fitter: Fitter,
    train: DataSource,
    cfg: LoopConfig,
    epoch: int,
    done: int,
    done_seconds: tuple[float, float],
    tick: tuple[float, float],
    checkpoint: Checkpoint | None,
    history: list,
    engine: Engine,
    converged: bool,
) -> None:
    """One epoch's batches from batch ``done`` on (those before it are in the checkpoint), each a step of
    ``engine``; a checkpoint every ``cfg.checkpoint_every`` batches."""
    batches = train.epoch_batches(
        cfg.batch_size,
        epoch,
        cfg.seed,
        cfg.shuffle,
        cfg.group,
        cfg.device,
        cfg.dtype,
        skip=done,
        in_place=engine.in_place,
    )
    progress = tqdm(
        batches,
        disable=cfg.verbose < 2,
        leave=False,
        desc=f"epoch {epoch}",
        unit="batch",
        mininterval=1.0 if sys.stderr.isatty() else 30.0,
    )
    for number, batch in enumerate(progress, start=done):
        uniforms = None
        if fitter.samples_assignments:  # drawn for the whole batch, so the same draws for any P
            uniforms = assignment_uniforms(cfg.seed, epoch, number, batch.size, cfg.device, cfg.dtype)
            uniforms = uniforms[cfg.group.share(slice(0, batch.size), batch.size)]
        engine.step(batch, epoch, number, uniforms)
        if checkpoint is not None and cfg.checkpoint_every and (number + 1) % cfg.checkpoint_every == 0:
            synchronize(cfg.device)
            checkpoint.save(
                epoch - 1,
                history,
                converged,
                fitter.state_dict(),
                batch=number + 1,
                epoch_seconds=_elapsed(done_seconds, tick),
            )

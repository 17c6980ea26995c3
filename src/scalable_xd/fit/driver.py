"""One fit from start to finish, apart from the estimator that exposes it: the data sources in, the
fitted mixture, its history and whether it converged out.

``fit_mixture`` executes a fit's plan (``fit.plan``, made and checked before any work): open the
checkpoint, choose the seed, find the starting point (the checkpoint's state, the previous fit's
parameters, or ``fit.starts.mixture`` from the given arrays and k-means), build the method's fitter
(``fit.methods``), configure the loop from the method's row, run it, and judge whether it converged.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning

from .. import deferred_checks
from .._torch import resolve_device, resolve_dtype
from ..background import Background
from ..data.batching import random_rows
from ..data.dataset import Dataset
from ..data.source import DataSource
from ..errors import FitDivergedError
from ..kernel.dispatch import fit_backend
from ..mixture import Mixture
from ..settings import FitSettings, resolve_seed
from .families.background_fit import BackgroundFit, background_of
from .families.reseed import dead_components
from .loop import last_gain, run
from .methods import make_fitter, method
from .plan import FitPlan, Start, settings_record
from .rules.em import FixedParameters
from .rules.sgd import feature_scale
from .run.checkpoint import Checkpoint, data_digest
from .run.loop_config import LoopConfig
from .run.parallel import Group, check_same_fit, fail_together, shared_seed
from .run.scoring import EVAL_BATCH, total_loglik
from .selection import record as selection_record
from .starts.mixture import feature_spread, initial_mixture, kmeans_sample

# Training stars that judge stochastic split-and-merge moves when no validation data are given.
JUDGE_SAMPLE = 20_000
# Training stars that k-means sees when the training data are not in memory (a ``ParquetSource``, an iterable).
KMEANS_SAMPLE = 1_000_000
# Epochs over which a minibatch method's convergence is judged (``_judged_converged``): the mean change a
# epoch over three has a third of one epoch's jitter where the likelihood wanders about a fixed level
STOCHASTIC_WINDOW = 3


@dataclass
class Fitted:
    """The fit's result: what it reports (the averaged parameters under Polyak averaging), its history
    (``fit.loop``), whether its last epoch gained less than ``tol``, and the warnings about the fitted model
    (``warnings``: (message, category)), which the caller gives where they concern the user's model (a
    restart's discarded starts do not)."""

    mixture: Mixture
    history: list
    converged: bool
    settings: FitSettings  # as run: the epoch budget resolved for the data (``methods.for_data``)
    background: Background | None = None  # with its fitted weight, where the fit had one
    warnings: list = field(default_factory=list)


def fit_mixture(plan: FitPlan) -> Fitted:
    """Run ``plan`` (``fit.plan``): fit a mixture of ``start.n_components`` to ``train`` (scored on ``val`` and
    each ``monitored`` set after every epoch where given), resuming from the ``checkpoint`` file where it
    exists and saving to it as it goes; under a known ``selection``, each batch with the points it removed
    (``selection``); with a uniform ``background`` (its starting weight), whose weight is fitted beside the
    mixture (``background_fit``).

    A float32 fit that diverges is fitted again in float64 with the same seed, and says so in a warning: a
    component that narrows onto a few stars measured without noise reaches condition numbers (1e8 on
    scikit-learn's breast-cancer table at K = 8) that float32's pass cannot resolve, while float64 fits it.
    Not where the fit checkpoints (its checkpoint is the float32 fit's) or runs data-parallel: those raise,
    naming ``dtype="float64"`` among the cures."""
    if plan.settings.dtype != "float32" or plan.checkpoint is not None or Group.current().parallel:
        return _fit_plan(plan)
    plan = replace(plan, random_state=resolve_seed(plan.random_state))  # the same seed for both
    try:
        return _fit_plan(plan)
    except FitDivergedError as err:
        diverged = err
    in_float64 = replace(plan, settings=replace(plan.settings, dtype="float64"), lockstep=None)  # steps alone
    fitted = _fit_plan(in_float64)
    said = f"The {diverged.diagnosis} in float32; it was fitted again in float64 with the same seed: this is that fit."
    fitted.warnings.append((said, UserWarning))
    return fitted


def _fit_plan(plan: FitPlan) -> Fitted:
    """``fit_mixture`` in the plan's dtype."""
    train, val, settings, kmeans, start = plan.train, plan.val, plan.settings, plan.kmeans, plan.start
    random_state, checkpoint, monitored = plan.random_state, plan.checkpoint, plan.monitored
    selection, background = plan.selection, plan.background
    group = Group.current()  # data-parallel under an initialised torch.distributed group (``fit.run.parallel``)
    with fail_together(group, "checking the checkpoint"):  # one rank's failure fails every rank
        device, dtype = resolve_device(settings.device), resolve_dtype(settings.dtype)
        store = None if checkpoint is None else Checkpoint(checkpoint, device)
    if random_state is None and store is not None and store.seed is not None:
        seed = store.seed  # a fit without random_state resumes with its checkpoint's seed
    else:
        seed = resolve_seed(random_state)
    record = _fingerprint(plan, settings)
    digest = data_digest(train) if group.parallel or store is not None else ""  # one pass over X, where needed
    if group.parallel:  # everything the processes must share, checked at once before any other collective
        check_same_fit(
            group, _shared_by_the_processes(train, val, monitored, record, digest, random_state, seed, store)
        )
    if random_state is None:
        seed = shared_seed(group, seed)  # one seed drawn for all the processes: rank 0's
    if store is not None:
        store.bind(record, seed, train, digest, val, (start.weights, start.means, start.covariances))
    sample = train if isinstance(train, Dataset) else kmeans_sample(train, KMEANS_SAMPLE, seed)  # in memory
    mixture = starting_mixture(sample, settings, kmeans, seed, start, store, device, dtype)
    w = regularisation(settings, sample, mixture)
    row = method(settings.method)
    backend = fit_backend(settings.backend, device)
    val = None if val is None else _resident(val, device, dtype)
    judge = None
    if settings.split_merge and row.split_merge == "epoch":
        judged = val
        if judged is None:
            judged = _resident(_training_sample(train, JUDGE_SAMPLE, seed, "split-and-merge judging"), device, dtype)
        judge = _judge(judged, device, dtype, backend, group)
    fixed = fixed_parameters(start.fixed, mixture)
    fitter = make_fitter(settings, mixture, fixed, judge, data_size=train.total_weight, w=w)
    if background is not None:
        fitter = BackgroundFit(fitter, background)
    every = plan.checkpoint_every if store is not None else 0
    loop = _loop_config(settings, seed, device, dtype, group, every, selection)
    loop.lockstep = plan.lockstep
    if isinstance(train, Dataset) and train.R is None:
        loop.least_noise = train.least_noise_variances().to(device)
    scored = train if not row.per_batch else _training_sample(train, settings.train_score_rows, seed, "scored")
    if row.per_batch:  # scored after every epoch: held on the device (a batch method scores its own pass)
        scored = _resident(scored, device, dtype)
    monitored = None if monitored is None else {name: _resident(d, device, dtype) for name, d in monitored.items()}
    history, converged = run(fitter, train, val, loop, store, monitored, scored)
    within_tol, not_converged = _judged_converged(history, settings, row.per_batch)
    converged = (converged or within_tol) and not_converged is None
    said = [not_converged, _dead_components(fitter.result, train.total_weight, fixed)]
    return Fitted(fitter.result, history, converged, settings, background_of(fitter), [w for w in said if w])


def _dead_components(mixture: Mixture, data_size: float, fixed) -> tuple[str, type] | None:
    """A warning where components (not of fixed weight) end with less than one star's worth of weight:
    capacity asked for that the fit does not use, said rather than left silent."""
    dead = dead_components(mixture.weights, 1.0 / data_size, None if fixed is None else fixed.weights)
    if not len(dead):
        return None
    return (
        f"{len(dead)} of {mixture.n_components} components ended with less than one star's worth of "
        f"weight (below 1/N = {1.0 / data_size:.3g}): capacity the fit does not use. Fit fewer components; "
        "minibatch EM re-seeds them at each epoch's end (reseed_dead)",
        UserWarning,
    )


def _fingerprint(plan: FitPlan, settings: FitSettings) -> dict:
    """What a checkpoint must have been written by to be resumed: the settings (``settings``: the budget
    resolved), the fixed masks, the selection and the background. How the fit is logged and which kernel
    computes it do not change its result: a fit resumes across them."""
    record = {
        **settings_record(plan.start.n_components, settings, plan.kmeans),
        "verbose": None,
        "backend": None,
        "cuda_graphs": None,
        "n_init": None,  # each start is the fit of its own seed, whatever the number of starts
    }
    record.update(plan.start.record())
    if plan.selection is not None:  # absent otherwise: checkpoints from before selections resume
        record["selection"] = selection_record(plan.selection, plan.train)
    if plan.background is not None:  # likewise
        record["background"] = plan.background.as_dict()
    return record


def _loop_config(
    settings: FitSettings, seed: int, device, dtype, group: Group, checkpoint_every: int, selection
) -> LoopConfig:
    """The loop's configuration, as the method's row says it runs."""
    row = method(settings.method)
    if settings.epochs is None or settings.batch_size is None:
        raise RuntimeError("methods.for_data resolves the epoch budget and the batch size for the data")
    return LoopConfig(
        epochs=settings.epochs,
        batch_size=settings.batch_size if row.per_batch else max(settings.batch_size, EVAL_BATCH),
        shuffle=row.per_batch,
        seed=seed,
        device=device,
        dtype=dtype,
        backend=fit_backend(settings.backend, device),
        cures=divergence_cures(settings),
        tol=settings.tol if row.uses_tol and not settings.split_merge else None,
        verbose=settings.verbose,
        group=group,
        checkpoint_every=checkpoint_every,
        defer_checks=deferred_checks.defers_on(device),
        graph_steps=settings.cuda_graphs and graphs_steps(device),
        selection=selection,
    )


def _resident(data: DataSource, device, dtype) -> DataSource:
    """Data scored after every epoch (or every split-and-merge move), held on the fit's device in its dtype
    where they are in memory and small enough (``Dataset.resident``); as they are otherwise."""
    return data.resident(device, dtype) if isinstance(data, Dataset) else data


def graphs_steps(device: torch.device) -> bool:
    """Whether minibatch steps on ``device`` run on static buffers, replayed as CUDA graphs
    (``engines.cuda``): on GPUs, where each of a step's ~100 kernels costs a launch."""
    return device.type == "cuda"


def _judged_converged(history: list, settings: FitSettings, per_batch: bool) -> tuple[bool, tuple[str, type] | None]:
    """Whether the fit's last epoch changed the mean training log-likelihood by less than ``tol``, up or down
    (the methods the loop does not stop by ``tol`` are judged so at the end), and otherwise scikit-learn's
    ``ConvergenceWarning`` as (message, category). A minibatch method's parameters jitter about its optimum by
    its step size, so it is judged on its mean change a epoch over its last ``STOCHASTIC_WINDOW`` epochs, within
    ``tol`` once its jitter is allowed for: two standard errors of that mean, sd / n for n changes of a
    log-likelihood that wanders about a fixed level (the mean is its last value less its first, over n), where the
    changes take both signs (of one sign they are a trend, and judged on their mean alone); and its
    last epoch must not have fallen by more than tol and every change before it in the window: a fall, never
    converged. ``tol=None`` asks for every epoch and judges nothing."""
    if settings.tol is None or len(history) < 2:
        return False, None
    gains = _recent_changes(history, STOCHASTIC_WINDOW if per_batch else 1)
    if gains is None:
        return False, None
    gain, epochs = float(gains.mean()), len(gains)
    # the jitter allowed for only where the changes wander (both signs): changes of one sign are a trend
    wanders = epochs > 1 and (gains > 0).any() and (gains <= 0).any()
    error = float(gains.std(ddof=1)) / epochs if wanders else 0.0
    # a last epoch that fell by more than tol and any change before it in the window is a fall, not jitter
    fell = epochs > 1 and gains[-1] < -(settings.tol + float(np.abs(gains[:-1]).max()))
    if abs(gain) < settings.tol + 2 * error and not fell:
        return True, None
    if fell:
        gain, error, epochs = float(gains[-1]), 0.0, 1
    if epochs == 1:
        over, by = "its last epoch", f"by {abs(gain):.3g} nats/star"
    else:
        over = f"its last {epochs} epochs"
        spread = f" ± {error:.2g}" if error else ""  # a trend of one sign: its mean alone
        by = f"by {abs(gain):.3g}{spread} nats/star a epoch on average"
    if gain > 0:
        advice = "still raised", "give it more epochs"
    elif per_batch:
        advice = (
            "lowered",
            "its steps move the parameters by more than tol allows about the optimum: lower the step size "
            "(step_size, lr), raise batch_size, average the iterates (averaging='polyak'), or raise tol to the "
            "change you accept",
        )
    else:
        advice = "lowered", "EM lowers it only by rounding: fit in float64, or raise tol"
    ran = history[-1]["epoch"]  # batch EM stops where an epoch lowers it, before its budget
    ended = f"ended by its budget of {ran} epochs" if ran == settings.epochs else f"stopped at epoch {ran}"
    return False, (
        f"{settings.method} {ended} while {over} {advice[0]} the mean "
        f"training log-likelihood {by}, more than tol = {settings.tol:g}: the fit has not converged; {advice[1]}",
        ConvergenceWarning,
    )


def _recent_changes(history: list, window: int) -> np.ndarray | None:
    """The training objective's changes over the last ``window`` epochs (fewer where the history is shorter);
    for one epoch, ``last_gain`` (SQUAREM's entries that are not one update from the one before skipped)."""
    if window == 1 or len(history) == 2:
        gain = last_gain(history)
        return None if gain is None else np.array([gain])
    recent = history[-min(window, len(history) - 1) - 1 :]
    key = "train_objective" if all("train_objective" in entry for entry in recent) else "train_loglik"
    return np.diff([entry[key] for entry in recent])


def starting_mixture(train: Dataset, settings, kmeans, seed: int, start: Start, store, device, dtype) -> Mixture:
    """The checkpoint's placeholder (its state replaces it), the previous fit, or the initial mixture from
    ``train`` (in memory: the training data, or ``kmeans_sample`` of data read from disk)."""
    if store is not None and store.saved is not None:  # the state comes from the checkpoint: skip k-means
        return Mixture.placeholder(start.n_components, train.model_dim, device)
    if start.warm is not None:  # of the fit's K and D (``plan.plan_fit``)
        return start.warm.to(device, torch.float64)
    return initial_mixture(
        train,
        start.n_components,
        kmeans,
        seed,
        device,
        dtype,
        weights=start.weights,
        means=start.means,
        covariances=start.covariances,
    )


def _shared_by_the_processes(train, val, monitored, record, digest, random_state, seed, store) -> dict:
    """What every process of a data-parallel fit must agree on, each setting by name: the training data
    (rows and digest), the validation and monitored data, the settings, whether a random_state was given
    (and which), and what checkpoint each found. Compared in one all_gather (``check_same_fit``) before any
    other collective, so that a difference fails every process with its name instead of hanging one."""
    return {
        "rows": len(train),
        "data": digest,
        **{f"setting {key}": value for key, value in record.items()},
        "random_state": "given" if random_state is not None else "none (rank 0's seed is drawn)",
        "seed": seed if random_state is not None else None,
        "validation data": None if val is None else [len(val), data_digest(val)],
        "eval_sets": sorted(monitored or {}),  # the parameter that gives them
        "checkpoint": None if store is None else (None if store.saved is None else f"epoch {store.saved['epoch']}"),
    }


def regularisation(settings: FitSettings, data: Dataset | None, mixture: Mixture) -> torch.Tensor | None:
    """The covariance regularisation's diagonal W (D,), float64 on the mixture's device, or None for none
    (w = 0): ``w`` in the features' own squared units (``w_scale="none"``: Bovy et al.'s w I), or ``w`` times
    each feature's variance in ``data`` (``"variance"``), so that one w means the same for a feature
    spread over 1e-4 and one over 1e4. Projected data (R changing the dimension) take the variance under
    the starting mixture, in the model's space. ``data`` may be None where w_scale is "none"."""
    if settings.w == 0:
        return None
    device, dim = mixture.means.device, mixture.dim
    if settings.w_scale == "none":
        return torch.full((dim,), settings.w, dtype=torch.float64, device=device)
    if data is None:
        raise ValueError('w_scale="variance" scales w by the data\'s variances: give the data')
    if data.R is not None and data.obs_dim != data.model_dim:
        variance = feature_scale(mixture) ** 2
    else:
        variance = feature_spread(data.X, data.observed_entries(), data.weights).to(device) ** 2
    return settings.w * variance


def divergence_cures(settings: FitSettings) -> str:
    """What could stop this fit diverging, for ``FitDivergedError``: only the settings whose change would
    change something (no "float64" for a fit in float64, no learning rate for batch EM)."""
    scale = "of each feature's variance" if settings.w_scale == "variance" else "in the features' units"
    cures = [f"a larger covariance regularisation w (now {settings.w:g} {scale})"]
    if settings.method == "sgd":
        cures.append(f"a smaller learning rate lr (now {settings.lr:g})")
    elif method(settings.method).per_batch:
        cures.append(f"a smaller step_size (now {settings.step_size:g})")
    if settings.dtype == "float32":
        cures.append('dtype="float64"')
    return ", ".join(cures[:-1]) + (" or " if len(cures) > 1 else "") + cures[-1]


def fixed_parameters(masks: dict[str, np.ndarray], mixture: Mixture) -> FixedParameters:
    """The masks as tensors, with the initial weights the fixed ones keep (all positive, summing to 1,
    so the free ones always have a share left)."""
    fixed = {k: torch.as_tensor(v, device=mixture.means.device) for k, v in masks.items()}
    return FixedParameters(fixed["fix_weights"], fixed["fix_means"], fixed["fix_covariances"], mixture.weights)


def _training_sample(train: DataSource, size: int | None, seed: int, what: str) -> DataSource:
    """A fixed random sample of the training data (``size`` stars at most; None: all), chosen by the seed,
    in memory: the split-and-merge judge's, or the points a minibatch fit scores after each epoch."""
    if size is None or len(train) <= size:
        return train
    return train.sample(random_rows(len(train), size, seed), f"the {what} sample of the training data")


def _judge(data: DataSource, device, dtype, backend: str, group: Group):
    """Mean log-likelihood of a mixture on ``data``: what decides a stochastic split-and-merge move."""
    return lambda mixture: total_loglik(data, mixture, device, dtype, backend, group) / data.total_weight

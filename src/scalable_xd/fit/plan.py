"""One fit's plan: everything it needs, resolved and checked before any work is done.

``checked_settings`` reads an estimator's parameters into the fit's settings and checks every rule across
them (each declared by its owner: what a method refuses on its row, ``methods.check_settings`` and
``check_fixed``; what a kernel cannot run, ``kernel.dispatch``); ``plan_fit`` checks the data and the fit's
options against the settings (checkpoints, monitored sets, the selection, the background) and returns the
``FitPlan`` that ``driver.fit_mixture`` executes. No k-means, no statistics pass runs until the plan is made,
so every refusal comes first (``tests/estimator/test_refusals.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from .._torch import resolve_device
from ..background import Background
from ..background import from_setting as background_from_setting
from ..data.dataset import Dataset
from ..data.inputs import monitored_data, training_data
from ..data.iterable import IterableSource
from ..data.source import DataSource
from ..kernel.dispatch import fit_backend
from ..mixture import Mixture
from ..settings import FitSettings, KMeansSettings, check_count, check_seed
from .families.background_fit import check_background
from .methods import check_fixed, check_settings, for_data
from .run.lockstep import Member, current
from .run.parallel import Group
from .selection import Selection, check_selection
from .selection import from_limits as selection_from_limits

log = logging.getLogger("scalable_xd.fit")

FIXED_MASKS = ("fix_weights", "fix_means", "fix_covariances")


@dataclass
class Start:
    """Where a fit begins unless its checkpoint says otherwise: the previous fit's parameters (``warm``,
    for ``warm_start``), else the given initial arrays (any may be None: k-means for the means and weights,
    identity covariances), with the ``fixed`` masks (``fix_weights``, ``fix_means``, ``fix_covariances``:
    boolean arrays of length K) holding parameters at their initial values."""

    n_components: int
    fixed: dict[str, np.ndarray]
    weights: object = None
    means: object = None
    covariances: object = None
    warm: Mixture | None = None

    def record(self) -> dict:
        """The fixed masks as lists, for the checkpoint's fingerprint."""
        return {name: mask.tolist() for name, mask in self.fixed.items()}


@dataclass
class FitPlan:
    """A fit, checked: its data (``train``, scored on ``val`` and each ``monitored`` set after every epoch),
    settings, seed (``random_state``), start, checkpoint (written every ``checkpoint_every`` batches inside
    an epoch where positive), and, where given, the known ``selection`` and the uniform ``background``."""

    train: DataSource
    val: DataSource | None
    settings: FitSettings
    kmeans: KMeansSettings
    random_state: object
    start: Start
    checkpoint: object = None
    checkpoint_every: int = 0
    monitored: dict | None = None
    selection: Selection | None = None
    background: Background | None = None
    lockstep: Member | None = None  # the fits this one steps with (``lockstep``), or None: alone


def fixed_masks(n_components: int, fix_weights, fix_means, fix_covariances) -> dict[str, np.ndarray]:
    """``fix_weights``, ``fix_means`` and ``fix_covariances`` (each True, False or a boolean array of length
    K) as boolean arrays of length K, or a ValueError naming the parameter."""
    masks = {}
    for name, value in (("fix_weights", fix_weights), ("fix_means", fix_means), ("fix_covariances", fix_covariances)):
        if isinstance(value, (bool, np.bool_)):
            masks[name] = np.full(n_components, bool(value))
            continue
        mask = np.asarray(value)
        if mask.dtype != bool or mask.shape != (n_components,):
            raise ValueError(
                f"{name} must be True, False or a boolean array of length n_components ({n_components}), got {value!r}"
            )
        masks[name] = np.ascontiguousarray(mask)  # a reversed view has negative strides torch refuses
    return masks


def settings_record(n_components, settings: FitSettings, kmeans: KMeansSettings) -> dict:
    """K and every fit and k-means setting as JSON-friendly values (k-means ones prefixed ``kmeans_``)."""
    return {
        "n_components": int(n_components),
        **settings.as_dict(),
        **{f"kmeans_{key}": value for key, value in kmeans.as_dict().items()},
    }


def checked_settings(params: dict) -> tuple[FitSettings, KMeansSettings]:
    """An estimator's parameters (``get_params()``) as the fit's settings, every rule across them checked:
    a ValueError naming the parameter."""
    settings = check_settings(FitSettings(**{name: params[name] for name in FitSettings.defaults()}))
    kmeans = KMeansSettings(epochs=params["kmeans_epochs"], batch_size=params["kmeans_batch_size"])
    check_count("n_components", params["n_components"])
    if not isinstance(params["random_state"], (np.random.RandomState, np.random.Generator, type(None))):
        check_seed("random_state", params["random_state"])
    if not isinstance(params["warm_start"], bool):
        raise ValueError(f"warm_start must be True or False, got {params['warm_start']!r}")
    if params["warm_start"] and settings.n_init is not None and settings.n_init > 1:
        raise ValueError(f"n_init={settings.n_init}: warm_start continues the fitted model, one start; set n_init=1")
    masks = fixed_masks(params["n_components"], *(params[name] for name in FIXED_MASKS))
    check_fixed(settings, any(mask.any() for mask in masks.values()))
    fit_backend(settings.backend, resolve_device(settings.device))  # one that cannot run there: named now
    return settings, kmeans


def plan_fit(
    settings: FitSettings,
    kmeans: KMeansSettings,
    start: Start,
    data: tuple,
    *,
    random_state=None,
    checkpoint=None,
    checkpoint_every: int = 0,
    eval_sets=None,
    selection=None,
    feature_names=None,
) -> FitPlan:
    """The plan of a fit of ``data`` (X, Xcov, R, X_val, Xcov_val, R_val, sample_weight, as ``fit`` takes
    them) from ``start``, with ``fit``'s options, each checked against the settings and the data: a
    ValueError naming what is refused. ``feature_names``: the features' names where the data do not carry
    them (a DataFrame's columns), for the selection setting's limits."""
    check_count("checkpoint_every", checkpoint_every, minimum=0)
    if checkpoint_every and checkpoint is None:
        raise ValueError("checkpoint_every: checkpoints inside an epoch need a checkpoint path (checkpoint=...)")
    if checkpoint_every and settings.split_merge:
        raise ValueError(
            "checkpoint_every: split_merge fits checkpoint at epochs' ends only (a move's trial spans an epoch)"
        )
    settings = for_options(settings, selection is not None or settings.selection is not None)
    X, Xcov, R, X_val, Xcov_val, R_val, sample_weight = data
    train, val = training_data(X, Xcov, R, X_val, Xcov_val, R_val, sample_weight, start.n_components, settings)
    warm = start.warm
    if warm is not None and (warm.n_components, warm.dim) != (start.n_components, train.model_dim):
        raise ValueError(
            f"warm_start: the fitted model has K = {warm.n_components} and D = {warm.dim}, "
            f"the new fit K = {start.n_components} and D = {train.model_dim}"
        )
    if Group.current().parallel and isinstance(train, IterableSource):
        raise ValueError(
            "X is an iterable of batches, which fits in one process: a data-parallel fit needs arrays or a "
            "ParquetSource, which every process splits the same way"
        )
    settings = for_data(with_starts(settings, len(train), start), len(train))  # the budget for the data
    if checkpoint_every and not getattr(train, "replays_epochs", True):
        raise ValueError(
            "checkpoint_every: X is an iterable of batches without set_epoch(epoch), so a resumed fit could "
            "not read the rest of the epoch it stopped in; checkpoint at epochs' ends (checkpoint_every=0), "
            "or give the iterable (or its sampler) a set_epoch that fixes each epoch's order"
        )
    monitored = monitored_data(eval_sets, train, settings)
    selection = _selection(selection, train, settings, feature_names)
    background = _background(train, settings, selection)
    return FitPlan(
        train,
        val,
        settings,
        kmeans,
        random_state,
        start,
        checkpoint,
        checkpoint_every,
        monitored,
        selection,
        background,
        current(),  # the fits it steps with, where it is made inside ``lockstep.Member.joined``
    )


# ``n_init=None``: this many starts where a fit is small, N x K at most ``AUTO_STARTS_PAIRS``. On 1,000 real
# DR2 rows (docs/user-guide/fitting.md) one default batch-EM start fell 0.04-0.08 nats a star short of the
# best of nine seeds on average, the best of three 0.01-0.04.
AUTO_STARTS, AUTO_STARTS_PAIRS = 3, 1_000_000


def with_starts(settings: FitSettings, n_rows: int, start: Start) -> FitSettings:
    """The settings with ``n_init`` resolved where it is None, and said on the ``scalable_xd.fit`` logger:
    ``AUTO_STARTS`` starts where the fit is small (N x K at most ``AUTO_STARTS_PAIRS``: restarts cost seconds)
    and its start is not given (given means or a warm start would start every restart alike), else one."""
    if settings.n_init is not None:
        return settings
    given = start.means is not None or start.warm is not None
    pairs = n_rows * start.n_components
    small = pairs <= AUTO_STARTS_PAIRS
    n_init = AUTO_STARTS if small and not given else 1
    why = "start given" if given else f"N x K = {pairs:,} {'<=' if small else '>'} {AUTO_STARTS_PAIRS:,}"
    log.info("n_init=None: %d start%s (%s)", n_init, "s" if n_init > 1 else "", why)
    return replace(settings, n_init=n_init)


def for_options(settings: FitSettings, selected: bool) -> FitSettings:
    """The settings with what an option needs of batch EM resolved where they are left at their defaults
    (as scikit-learn's "auto" settings resolve), and said on the ``scalable_xd.fit`` logger: under a
    selection (``selected``), EM is Monte Carlo EM, whose log-likelihood moves by about 1/sqrt(N) between
    passes, so neither ``tol`` nor SQUAREM can judge it: ``tol`` None and ``acceleration`` "none"; with a
    background, SQUAREM (which extrapolates the mixture's parameters only) gives way to plain EM. A value
    given that differs from the default is kept, and refused where the option cannot take it."""
    if settings.method != "em" or not (selected or settings.background is not None):
        return settings
    defaults = FitSettings.defaults()
    chosen: dict[str, object] = {"acceleration": "none"}
    if selected:
        chosen["tol"] = None
    chosen = {name: value for name, value in chosen.items() if getattr(settings, name) == defaults[name]}
    if chosen:
        why = "a selection's Monte Carlo EM" if selected else "a background"
        log.info("%s: %s", why, ", ".join(f"{name}={value!r}" for name, value in chosen.items()))
    return replace(settings, **chosen)  # type: ignore[arg-type]


def _background(train: DataSource, settings: FitSettings, selection) -> Background | None:
    """The ``background`` setting's box with its starting weight, checked against the fit; None where
    there is none."""
    if settings.background is None:
        return None
    X = train.X if isinstance(train, Dataset) else None
    background = background_from_setting(settings.background, X, settings.background_weight)
    check_background(background, train, settings, selection)
    return background


def _selection(given, train: DataSource, settings: FitSettings, feature_names) -> Selection | None:
    """The fit's selection, checked: ``fit``'s ``selection`` argument (a ``Selection`` or a callable), or
    the ``selection`` setting's limits on the features by name (a Parquet source's columns, a
    DataFrame's, else x0, x1, ...), or both where the argument was read from the setting's limits (the
    workflow's, which names its features); None where neither is given or ``selection_aware`` is False."""
    if given is not None and settings.selection is not None and getattr(given, "spec", None) != settings.selection:
        raise ValueError(
            f"selection: given twice, to fit and as the setting selection={settings.selection!r}; give one"
        )
    if not settings.selection_aware:
        return None
    if given is not None:
        selection = given if isinstance(given, Selection) else Selection(given, on=settings.selection_on)
    elif settings.selection is not None:
        names = getattr(train, "x_columns", None) or feature_names
        names = list(names) if names is not None else [f"x{i}" for i in range(train.obs_dim)]
        selection = selection_from_limits(settings.selection, names, settings.selection_on)
    else:
        return None
    check_selection(selection, train, settings)
    return selection

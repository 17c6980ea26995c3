"""``XDGMM``: the user-facing estimator, in scikit-learn's style (fit / score / sample / save / load).

``fit`` makes the fit's plan (``fit.plan``: the settings and the data checked before any work) and hands it
to ``fit.restarts.fit_best_of``, which runs it; ``save`` and ``load`` are ``saved_model``'s; what a fitted
model answers (scores, posteriors, samples, ...) is ``fitted_model.FittedXD``'s.
"""

from __future__ import annotations

import functools
import types
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
from sklearn.base import BaseEstimator, DensityMixin

from . import saved_model
from .background import Background
from .data.inputs import training_source
from .fit.methods import METHODS, SETTING_CHOICES, setting_help
from .fit.partial import OnlineFit, check_options, checked_batch, refusal
from .fit.plan import FIXED_MASKS, Start, checked_settings, fixed_masks, plan_fit, settings_record
from .fit.restarts import fit_best_of
from .fit.run.parallel import Group, fail_together
from .fitted_model import FittedXD
from .settings import FitSettings, KMeansSettings, numpydoc_parameters
from .sklearn_input import checked_input

# The fields' declared defaults (a FitSettings instance would hold the method's resolved epoch budget).
_FIT, _KMEANS = SimpleNamespace(**FitSettings.defaults()), KMeansSettings()


class _only_per_batch:
    """``partial_fit`` where the estimator's method updates per batch (a minibatch method without
    split-and-merge, whose trials span whole epochs); otherwise an AttributeError whose message is the
    reason, so that ``hasattr(model, "partial_fit")`` is False, as scikit-learn's ``available_if`` makes it,
    but the user reads why (``available_if`` would say only that it "has no attribute"). An unknown method
    has it, for ``partial_fit`` to name the mistake."""

    def __init__(self, method):
        self.method = method
        functools.update_wrapper(self, method)

    def __get__(self, obj, owner=None):
        if obj is None:
            return self.method  # the class's: its docstring, scikit-learn's metadata routing
        reason = obj.method in METHODS and refusal(obj.method, obj.split_merge is True)
        if reason:
            raise AttributeError(reason)
        return types.MethodType(self.method, obj)


class XDGMM(FittedXD, DensityMixin, BaseEstimator):
    """Extreme deconvolution: a Gaussian mixture for the true values behind noisy, projected data.

    Each observation is x_i = R_i v_i + noise with noise ~ N(0, S_i) known per point; the model is
    p(v) = sum_j alpha_j N(v | m_j, V_j), so p(x_i) = sum_j alpha_j N(x_i | R_i m_j, R_i V_j R_i^T + S_i).

    Parameters
    ----------
    n_components : int, default=1
        The number of mixture components K.
    {fit_settings}
    {kmeans_settings}
    random_state : None, int, numpy RandomState or Generator, default=None
        Seeds k-means and the batch order.
    warm_start : bool, default=False
        A second ``fit`` starts from the fitted parameters instead of k-means, and its ``history_`` and
        ``n_iter_`` count on from the first fit's.
    weights_init, means_init, covariances_init : array-like, default=None
        Explicit initial parameters, (K,), (K, D) and (K, D, D); any may be given alone. Weights lie in
        (0, 1] and sum to 1; covariances are symmetric positive definite (refused otherwise, as scikit-learn
        refuses them).
    fix_weights, fix_means, fix_covariances : bool or array-like of bool, default=False
        Hold these parameters at their initial values, for every component (True) or for those marked in
        a boolean array of length K (Bovy et al.'s fixamp, fixmean and fixcovar; see
        ``fit.rules.em.FixedParameters``).

        Defaults and constraints live in ``settings.FitSettings``; they are checked when ``fit`` is called, as
        in scikit-learn, whose estimator contract ``XDGMM`` follows (``clone``, ``get_params``/``set_params``,
        ``GridSearchCV`` over ``n_components`` with ``score``). A non-finite or non-positive-definite component
        raises ``FitDivergedError`` naming the epoch and component; a component whose responsibilities
        underflow to zero is frozen with weight zero, as in Bovy's code.
    """

    # The settings' entries are written from ``settings.FitSettings``, where each default is declared.
    _online: OnlineFit | None  # partial_fit's running state (None after fit)
    _background: Background | None  # the fitted background, where the model has one

    __doc__ = __doc__.replace(
        "    {fit_settings}", numpydoc_parameters(FitSettings, choices=SETTING_CHOICES, help_of=setting_help)
    ).replace("    {kmeans_settings}", numpydoc_parameters(KMeansSettings, prefix="kmeans_"))

    def __init__(
        self,
        n_components: int = 1,
        method: str = _FIT.method,
        *,
        epochs: int | None = _FIT.epochs,
        batch_size: int | None = _FIT.batch_size,
        step_size: float = _FIT.step_size,
        step_schedule: str = _FIT.step_schedule,
        step_decay: float = _FIT.step_decay,
        kappa: float = _FIT.kappa,
        lr: float = _FIT.lr,
        lr_decay: float = _FIT.lr_decay,
        decay_epoch: int | None = _FIT.decay_epoch,
        sgd_scaling: str = _FIT.sgd_scaling,
        w: float = _FIT.w,
        w_scale: str = _FIT.w_scale,
        online_regularisation: str = _FIT.online_regularisation,
        tol: float | None = _FIT.tol,
        train_score_rows: int | None = _FIT.train_score_rows,
        acceleration: str = _FIT.acceleration,
        split_merge: bool = _FIT.split_merge,
        split_merge_tries: int = _FIT.split_merge_tries,
        n_init: int | None = _FIT.n_init,
        averaging: str = _FIT.averaging,
        truncation: bool = _FIT.truncation,
        truncation_bound: float = _FIT.truncation_bound,
        reseed_dead: bool = _FIT.reseed_dead,
        covariance_update: str = _FIT.covariance_update,
        missing: str = _FIT.missing,
        selection: str | None = _FIT.selection,
        selection_on: str = _FIT.selection_on,
        selection_aware: bool = _FIT.selection_aware,
        background: str | None = _FIT.background,
        background_weight: float = _FIT.background_weight,
        device: str = _FIT.device,
        dtype: str = _FIT.dtype,
        backend: str = _FIT.backend,
        cuda_graphs: bool = _FIT.cuda_graphs,
        verbose: int = _FIT.verbose,
        kmeans_epochs: int = _KMEANS.epochs,
        kmeans_batch_size: int = _KMEANS.batch_size,
        random_state=None,
        warm_start: bool = False,
        weights_init=None,
        means_init=None,
        covariances_init=None,
        fix_weights=False,
        fix_means=False,
        fix_covariances=False,
    ):
        # scikit-learn's contract: every parameter stored under its own name, as given (checked in ``fit``)
        for name, value in locals().items():
            if name != "self":
                setattr(self, name, value)

    # ------------------------------------------------------------------ configuration

    def _validated(self) -> tuple[FitSettings, KMeansSettings]:
        """The settings, checked once per fit (as scikit-learn estimators do): ``plan.checked_settings``."""
        return checked_settings(self.get_params())

    def _fixed_masks(self) -> dict[str, np.ndarray]:
        """``fix_weights``, ``fix_means`` and ``fix_covariances`` as boolean arrays of length K (checked)."""
        return fixed_masks(self.n_components, *(getattr(self, name) for name in FIXED_MASKS))

    def describe(self) -> dict:
        """The settings of the fitted model as JSON-friendly values (saved with it and in the metrics)."""
        seed = self.random_state if isinstance(self.random_state, (int, np.integer)) else None
        k = self._fitted().n_components  # the fitted model's, whatever set_params has changed since
        return {**settings_record(k, self.settings_, self.kmeans_settings_), "random_state": seed}

    # ------------------------------------------------------------------ fitting

    def fit(
        self,
        X,
        y=None,
        *,
        Xcov=None,
        R=None,
        sample_weight=None,
        X_val=None,
        Xcov_val=None,
        R_val=None,
        checkpoint=None,
        checkpoint_every: int = 0,
        eval_sets=None,
        selection=None,
    ) -> XDGMM:
        """Fit to X (N, d) with noise covariances Xcov: (N, d, d), diagonal variances (N, d), a
        ``CompactCovariance``, a ``NoiseMixture`` (each point's noise a Gaussian mixture, or samples:
        docs/user-guide/noise-mixtures.md), or None for noiseless data. X (and X_val) may instead be a
        ``stream.ParquetSource``, data read from disk a window at a time; an iterable of ``(X, Xcov)`` or
        ``(X, Xcov, weights)`` batches, such as a PyTorch ``DataLoader``, read once per epoch in its own
        order and batch sizes (``iterable``); or any other ``source.DataSource``. Each carries its own noise
        (no Xcov, R or sample_weight beside it), and k-means sees a sample of 1,000,000 of its stars.
        ``R`` (N, d, D) projects the model space onto the data (identity when None). ``sample_weight``
        (N,): non-negative weights, a point of weight 2 counting as two copies (Bovy's ``weight``; the
        k-means initial means ignore them). Validation data, if given, is scored after every epoch.
        ``checkpoint``: a file written atomically after each epoch (and every ``checkpoint_every`` batches
        inside one, for epochs too long to lose: not with split_merge); if it exists, the fit resumes from it
        where it was written (inside an epoch, an iterable of batches needs ``set_epoch``, so that it can
        give that epoch again). ``eval_sets``: {name: (X, Xcov) or (X, Xcov, R)},
        more data scored after every epoch as validation data are (each history entry's ``<name>_loglik``)
        without entering the fit, e.g. a mock's noise-free values with zero covariances, to follow how well
        the deconvolved density is recovered epoch by epoch. ``selection``: where X holds only the points a
        known selection kept, a ``fit.selection.Selection`` (or a callable from values (n, d) to the
        probability (n,) that a point is kept, a selection on the observed values): the model is then of the
        whole population, every batch carrying its share of the points the selection removed, drawn from the
        current model (Monte Carlo EM, as in Melchior & Goulding 2018; docs/user-guide/selection.md).

        ``n_init`` starts (seeds ``random_state + s``) are fitted on the data read once (the minibatch methods'
        in lockstep, each step one pass and one update for all of them; batch EM's one after another), and
        the best is kept (``fit.restarts``): ``start_scores_`` holds each start's final mean log-likelihood
        (validation where given, else training; None where it diverged) and ``best_start_`` the one kept.

        Data-parallel: called on every process of an initialised ``torch.distributed`` group (each with the
        same data and settings), every global batch is split across the processes and their sums are
        reduced, so all of them end with the same model; only rank 0 writes the checkpoint (see
        ``fit.run.parallel``; ``torchrun ... -m scalable_xd fit`` sets this up).
        """
        with fail_together(Group.current(), "checking the inputs"):  # one rank's bad data fails all
            settings, kmeans = self._validated()
            X, sample_weight = checked_input(self, X, y, R, sample_weight, "fit", reset=True)
            self._online = None  # a fit starts afresh, whatever partial_fit did before
            warm = self._mixture if self.warm_start and hasattr(self, "_mixture") else None
            init = (self.weights_init, self.means_init, self.covariances_init)
            start = Start(self.n_components, self._fixed_masks(), *init, warm=warm)
            plan = plan_fit(
                settings,
                kmeans,
                start,
                (X, Xcov, R, X_val, Xcov_val, R_val, sample_weight),
                random_state=self.random_state,
                checkpoint=checkpoint,
                checkpoint_every=checkpoint_every,
                eval_sets=eval_sets,
                selection=selection,
                feature_names=getattr(self, "feature_names_in_", None),
            )
        fitted, restarts = fit_best_of(plan)
        history = fitted.history if warm is None else _continued(self.history_, fitted.history)
        # n_init as given (None: chosen per fit, and ``start_scores_`` has one score per start fitted)
        given = replace(fitted.settings, n_init=settings.n_init)
        self._set_fitted(fitted.mixture, history, fitted.converged, given, kmeans, fitted.background)
        self.n_features_in_ = plan.train.obs_dim
        self.start_scores_, self.best_start_ = restarts.scores, restarts.best
        self._fitted_to_noise = Xcov is not None  # arrays scored without their noise are then warned of
        return self

    @_only_per_batch
    def partial_fit(self, X, y=None, *, Xcov=None, R=None, sample_weight=None) -> XDGMM:
        """One minibatch update from the batch given, for data that arrive a batch at a time (scikit-learn's
        online-learning convention). The first call starts from ``*_init`` or from k-means on its batch; the
        running state (online EM's statistics and step count, Adam's moments) carries over, so calls over a
        stream's batches give the model ``fit`` would over the same batches in the same order. Minibatch
        methods only. A stream has no epochs and no known size: the step size is the schedule's first (the
        "cappe_moulines" and "power" schedules decay with the updates), and minibatch EM's prior counts the
        stars seen so far (``fit.partial``). ``history_`` gains an entry per call (its batch's mean
        log-likelihood before the update) and ``n_iter_`` counts the updates. ``save`` keeps the running
        state and ``load`` restores it; a model fitted by ``fit`` goes on from its parameters with a fresh
        state. ``fit`` starts afresh."""
        settings, kmeans = self._validated()
        check_options(settings)
        online = getattr(self, "_online", None)
        if online is not None:
            online.check_settings(settings_record(self.n_components, settings, kmeans))
        warm = getattr(self, "_mixture", None)  # fitted (or loaded) without a running state: go on from it
        first = online is None and warm is None
        X, sample_weight = checked_input(self, X, y, R, sample_weight, "partial_fit", reset=first)
        n_kmeans = self.n_components if first and self.means_init is None else None  # k-means needs K points
        batch = training_source(X, Xcov, R, sample_weight, settings, n_kmeans)
        checked_batch(batch, online, warm, getattr(self, "n_features_in_", None))
        if online is None:
            init = (self.weights_init, self.means_init, self.covariances_init)
            start = Start(self.n_components, self._fixed_masks(), *init, warm=warm)
            online = OnlineFit(batch, settings, kmeans, self.random_state, start)
            self.history_: list[dict] = []
        entry = online.update(batch)
        history = [*self.history_, entry]
        self._set_fitted(online.fitter.result, history, False, online.settings, kmeans)
        self._online = online
        self.n_features_in_ = batch.obs_dim
        return self

    def __sklearn_tags__(self):
        """What scikit-learn's checks may assume: a density estimator (``DensityMixin``) of real 2-D data,
        negative values as welcome as positive ones, and NaN allowed where it marks a missing entry."""
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = self.missing == "marginalise"
        return tags

    # ------------------------------------------------------------------ persistence

    def save(self, path) -> None:
        """Write parameters, settings and history to one ``.npz`` file, atomically (see ``model_file``)."""
        saved_model.save(self, path)

    @classmethod
    def load(cls, path, device: str | None = None) -> XDGMM:
        """Read a model written by ``save``; ``device`` overrides the saved one (e.g. "cpu" for a GPU fit).

        The file is read without unpickling, and its parameters and settings are checked as strictly as a
        fit's: a damaged, foreign or invalid file raises ValueError naming it."""
        return saved_model.load(cls, path, device)


def _continued(before: list[dict], after: list[dict]) -> list[dict]:
    """A warm-started fit's history after the one it continued: its epochs and training (wall and CPU) seconds
    counted on from where ``before`` ended (its entry 0, the parameters ``before`` ended with, is dropped)."""
    if not before:
        return after
    last = before[-1]
    shifted = [{**e, "epoch": e["epoch"] + last["epoch"], "seconds": e["seconds"] + last["seconds"]} for e in after[1:]]
    if "cpu_seconds" in last:  # a history written before CPU seconds were recorded has none to count on from
        for entry in shifted:
            entry["cpu_seconds"] = entry.get("cpu_seconds", 0.0) + last["cpu_seconds"]
    return before + shifted

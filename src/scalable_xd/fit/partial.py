"""Online learning one batch at a time (``XDGMM.partial_fit``): the state carried between calls.

A minibatch fit is a sequence of updates, each from one batch's statistics. ``OnlineFit`` makes them one
call at a time: the first batch starts the fit (from a fitted model's parameters, the given initial ones,
else k-means on that batch, as scikit-learn's ``MiniBatchKMeans.partial_fit`` does) and each call makes
one update, through the same kernel and the same fitter that ``fit`` uses, so the same batches in the
same order give the same model. What a stream cannot say is how many stars there are, or where its
epochs end: the step size is the schedule's at its first epoch (the ``"cappe_moulines"`` and ``"power"``
schedules decay with the count of updates, as over a stream they should), minibatch EM's prior
(``online_regularisation="prior"``) takes the stars seen so far as the data's size, and the
regularisation relative to the data's variance (``w_scale="variance"``) takes the first batch's.
"""

from __future__ import annotations

import dataclasses
import time

from .._torch import resolve_device, resolve_dtype, synchronize
from ..data.dataset import Dataset
from ..errors import brief
from ..kernel.dispatch import batch_statistics, fit_backend
from ..settings import FitSettings, KMeansSettings, resolve_seed
from .driver import fixed_parameters, regularisation, starting_mixture
from .loop import assignment_uniforms, resume_state
from .methods import METHODS, for_data, make_fitter, method
from .plan import Start, settings_record


def refusal(method_name: str, split_merge: bool) -> str | None:
    """Why ``partial_fit`` cannot run ``method_name`` (with ``split_merge``), or None where it can."""
    if method(method_name).per_batch and not split_merge:
        return None
    minibatch = ", ".join(name for name, m in METHODS.items() if m.per_batch)
    return (
        f"partial_fit makes one minibatch update per call, which method {method_name!r}"
        f"{' with split_merge' if split_merge else ''} does not: use one of {minibatch} "
        "(split-and-merge trials span whole epochs), or fit"
    )


def check_options(settings: FitSettings) -> None:
    """Refuse, naming the setting, what a stream fitted a batch at a time cannot take."""
    if settings.selection is not None and settings.selection_aware:
        raise ValueError(
            f"selection={settings.selection!r}: partial_fit takes no selection (a stream has no population "
            "to draw the removed points against); fit takes one"
        )
    if settings.background is not None:
        raise ValueError(f"background={settings.background!r}: partial_fit fits no background; fit does")
    if settings.n_init is not None and settings.n_init > 1:  # None: one start here
        raise ValueError(
            f"n_init={settings.n_init}: partial_fit carries one running state from call to call, and restarts "
            "need whole fits of the data; fit takes n_init"
        )


def checked_batch(batch, online: OnlineFit | None, warm, n_features: int | None) -> None:
    """Refuse a batch (a data source) that ``partial_fit`` cannot take: not one batch of arrays, or of other
    dimensions than the running state's (``online``: its ``n_features`` measured features, its model's) or
    the fitted model's (``warm``) that the call goes on from."""
    if not isinstance(batch, Dataset):
        raise ValueError(
            f"partial_fit takes one batch of arrays per call, and X is a {type(batch).__name__}: call it once "
            "per batch, or give the whole source to fit"
        )
    if online is None and warm is not None and batch.model_dim != warm.dim:
        raise ValueError(
            f"partial_fit: this batch has {batch.model_dim} features, the fitted model {warm.dim} (partial_fit "
            "after fit goes on from the fitted model)"
        )
    if online is not None and batch.obs_dim != n_features:
        raise ValueError(f"partial_fit: this batch has {batch.obs_dim} features, the earlier ones {n_features}")
    if online is not None and batch.model_dim != online.fitter.result.dim:
        dim = online.fitter.result.dim
        raise ValueError(
            f"partial_fit: this batch's R projects from {batch.model_dim} model dimensions, the model has "
            f"{dim}: R must have shape (N, {batch.obs_dim}, {dim})"
        )


class OnlineFit:
    """A minibatch fitter and what it needs between ``partial_fit`` calls."""

    def __init__(self, first, settings: FitSettings, kmeans: KMeansSettings, random_state, start: Start):
        reason = refusal(settings.method, settings.split_merge)
        if reason:
            raise ValueError(reason)
        self.kmeans = kmeans
        self._configure(settings, len(first), resolve_seed(random_state))
        mixture = starting_mixture(first, settings, kmeans, self.seed, start, None, self.device, self.dtype)
        self._start_fitter(mixture, start, regularisation(self.settings, first, mixture))
        self.seen, self.seconds, self.updates = 0.0, 0.0, 0

    def check_settings(self, record: dict) -> None:
        """Refuse a call whose settings (``plan.settings_record``, K included) differ from those the
        running state was started with: set_params between calls would otherwise be ignored."""
        started = settings_record(self.fitter.result.n_components, self.given, self.kmeans)
        changed = [key for key in record if key != "verbose" and record[key] != started.get(key)]
        if changed:
            what = ", ".join(f"{key} {brief(started.get(key))} -> {brief(record[key])}" for key in changed)
            raise ValueError(
                f"partial_fit: {what} since the running state began (set_params?); it belongs to the old "
                "settings: set them back, or call fit to start afresh with the new ones"
            )

    def _configure(self, settings: FitSettings, n_points: int, seed: int) -> None:
        self.given = settings
        self.settings = for_data(settings, n_points)
        self.device, self.dtype = resolve_device(settings.device), resolve_dtype(settings.dtype)
        self.seed = seed
        self.backend = fit_backend(settings.backend, self.device)

    def _start_fitter(self, mixture, start, w) -> None:
        self.w = w
        fixed = fixed_parameters(start.fixed, mixture)
        self.fitter = make_fitter(self.settings, mixture, fixed, data_size=1.0, w=w)
        self.fitter.start_epoch(0)

    def state_dict(self) -> dict:
        """Tensors and plain data from which ``resumed`` continues exactly (``XDGMM.save`` keeps them)."""
        counts = {"seen": self.seen, "seconds": self.seconds, "updates": self.updates, "seed": self.seed}
        return {"fitter": self.fitter.state_dict(), "w": self.w, **counts}

    @classmethod
    def resumed(
        cls, mixture, settings: FitSettings, kmeans: KMeansSettings, start, state: dict, what: str
    ) -> OnlineFit:
        """The online fit a ``state_dict`` describes, its fitter built around ``mixture`` and then loaded, or
        a ValueError (``what`` holds ...) where the state does not fit it (``loop.resume_state``)."""
        online = cls.__new__(cls)
        online.kmeans = kmeans
        online._configure(settings, max(1, int(state["seen"])), int(state["seed"]))
        if "w" in state:
            w = None if state["w"] is None else state["w"].to(online.device)
        else:  # a file written before w_scale, whose w was in the features' own units
            w = regularisation(dataclasses.replace(settings, w_scale="none"), None, mixture.to(online.device))
        online._start_fitter(mixture.to(online.device, mixture.weights.dtype), start, w)
        resume_state(online.fitter, state["fitter"], what, "the file is not as XDGMM.save wrote it")
        online.seen, online.seconds, online.updates = (
            float(state["seen"]),
            float(state["seconds"]),
            int(state["updates"]),
        )
        return online

    def update(self, batch) -> dict:
        """One update from ``batch`` (a validated data set, all of it one minibatch); its history entry."""
        tick = time.perf_counter()
        _, x, S, R, weights, observed = next(batch.scan(slice(0, len(batch)), len(batch), self.device, self.dtype))
        uniforms = None
        if self.fitter.samples_assignments:
            # drawn as fit draws its first epoch's (epochs count from 1), numbered by update
            uniforms = assignment_uniforms(self.seed, 1, self.updates, len(batch), self.device, self.dtype)
        self.seen += batch.total_weight
        inner = getattr(self.fitter, "inner", self.fitter)  # under Polyak averaging, the averaged fitter
        if getattr(inner, "data_size", None) is not None:  # minibatch EM's prior
            inner.resize(self.seen)  # type: ignore[union-attr]  # its size: the stars seen so far, this batch's too
        stats = batch_statistics(
            x,
            S,
            self.fitter.mixture,
            R,
            backend=self.backend,
            point_weights=weights,
            uniforms=uniforms,
            observed=observed,
        )
        assert stats.loglik is not None  # the kernel's pass sums it
        loglik = float(stats.loglik) / float(stats.n_points)
        self.fitter.observe(stats)
        synchronize(self.device)
        self.seconds += time.perf_counter() - tick
        self.updates += 1
        return {"epoch": self.updates, "seconds": self.seconds, "train_loglik": loglik, "val_loglik": None}

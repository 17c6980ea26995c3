"""``XDGMM.save`` and ``XDGMM.load``: a fitted estimator to its model file (``model_file``) and back, its
settings checked as strictly as a fit's, and a ``partial_fit`` in progress with its running state."""

from __future__ import annotations

import numpy as np
import torch

from ._torch import dtype_name, resolve_device
from .background import Background
from .fit.partial import OnlineFit
from .fit.plan import FIXED_MASKS, Start
from .model_file import read_model, read_online_state, write_model


def save(model, path) -> None:
    """Write ``model`` (a fitted ``XDGMM``) to ``path``, atomically."""
    online = getattr(model, "_online", None)
    write_model(
        path,
        model._fitted(),
        {
            # as given, so that a loaded model refits as this one would: the budget resolved anew for its data
            "params": {
                **model.describe(),
                "epochs": model.epochs,
                "decay_epoch": model.decay_epoch,
                "batch_size": model.batch_size,
                # the held parameters, so that a loaded model (and its partial_fit) holds them too
                **{name: np.asarray(getattr(model, name)).tolist() for name in FIXED_MASKS},
            },
            "history": model.history_,
            "converged": model.converged_,
            "dtype": dtype_name(model._dtype),
            "n_features_in": getattr(model, "n_features_in_", None),
            # the columns of the DataFrame it was fitted to, so that a loaded model checks a frame's names too
            "feature_names_in": None if not hasattr(model, "feature_names_in_") else list(model.feature_names_in_),
            "background": None if model._background is None else model._background.as_dict(),
            "starts": {"scores": getattr(model, "start_scores_", None), "best": getattr(model, "best_start_", None)},
        },
        None if online is None else online.state_dict(),
    )


def load(cls, path, device: str | None = None):
    """The ``cls`` (``XDGMM``) saved at ``path``, on ``device`` where given (else the saved one, or the CPU
    where the saved GPU is absent); a ValueError naming the file where it is damaged, foreign or invalid.
    ``verbose`` comes back at its default: how the fitting process showed its progress (the workflow's
    fits log every epoch) is not part of the model."""
    mixture, meta = read_model(path)
    params = dict(meta.get("params", {}))
    params.pop("verbose", None)
    saved = params.get("device", "cpu")
    if device is None and saved != "cpu" and not torch.cuda.is_available():
        device = "cpu"
    if device is not None and device != saved:  # the saved backend may not run there (triton on a CPU)
        params.update(device=device, backend="auto")
    try:
        model = cls(**params)
        settings, kmeans = model._validated()
        on = resolve_device(settings.device)
    except (TypeError, ValueError) as err:
        raise ValueError(f"model {path} has invalid settings: {err}") from None
    if model.n_components != mixture.n_components:
        raise ValueError(
            f"model {path}: n_components is {model.n_components} but it holds {mixture.n_components} components"
        )
    try:
        background = Background.from_dict(meta["background"]) if meta.get("background") else None
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"model {path} holds an invalid background: {err}") from None
    history, converged = meta.get("history", []), meta.get("converged", False)
    model._set_fitted(mixture.to(on), history, converged, settings, kmeans, background)
    model.n_features_in_ = meta.get("n_features_in") or mixture.dim  # files before it was saved: R = I
    if meta.get("feature_names_in") is not None:
        model.feature_names_in_ = np.asarray(meta["feature_names_in"], dtype=object)
    starts = meta.get("starts") or {}
    if starts.get("scores") is not None:  # a model fit wrote (not partial_fit, nor files before restarts)
        model.start_scores_, model.best_start_ = starts["scores"], starts["best"]
    if meta.get("online_state"):  # a model partial_fit was training: its running state goes on
        start = Start(model.n_components, model._fixed_masks())
        state = read_online_state(path, on)
        what = f"model {path}: its online_state"
        model._online = OnlineFit.resumed(model._mixture, settings, kmeans, start, state, what)
    return model

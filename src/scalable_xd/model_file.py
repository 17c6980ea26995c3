"""The model file ``XDGMM.save`` writes: one ``.npz`` of float arrays (weights, means, covariances) and a JSON
``meta`` string (format version, settings, history). It is read without unpickling anything, and a
damaged, foreign or invalid file is refused with a ValueError that names it.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from .io import atomic_path, read_npz
from .mixture import Mixture

FORMAT_VERSION = 1
ARRAYS = ("weights", "means", "covariances")


def write_model(path, mixture: Mixture, meta: dict) -> None:
    arrays = {key: getattr(mixture, key).detach().cpu().numpy() for key in ARRAYS}
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, **arrays, meta=np.array(json.dumps({"format_version": FORMAT_VERSION, **meta})))


def read_model(path) -> tuple[Mixture, dict]:
    """The mixture (float64, checked as strictly as a fit's) and the meta dictionary of a model file."""
    not_ours = f"{path} is not a model written by XDGMM.save"
    arrays = read_npz(path, (*ARRAYS, "meta"), not_ours)
    try:
        meta = json.loads(str(arrays.pop("meta")))
    except ValueError as err:
        raise ValueError(
            f"{not_ours}: it is empty, truncated or of another format ({err.__class__.__name__})"
        ) from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise ValueError(f"{path}: unsupported model format version {version!r} (this version reads {FORMAT_VERSION})")
    if any(a.dtype.kind != "f" for a in arrays.values()):
        raise ValueError(f"{path}: weights, means and covariances must be floating-point arrays")
    mixture = Mixture(*(torch.as_tensor(arrays[key], dtype=torch.float64) for key in ARRAYS))
    mixture.check(f"model {path}")
    return mixture, meta

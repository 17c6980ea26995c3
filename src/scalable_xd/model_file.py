"""The model file ``XDGMM.save`` writes: one ``.npz`` of float arrays (weights, means, covariances) and a JSON
``meta`` string (format version, settings, history), and, for a model that ``partial_fit`` is still
training, ``online_state``: the running state as ``torch.save`` bytes, read back with
``torch.load(weights_only=True)``, which admits tensors and plain data only. It is read without unpickling
anything, and a damaged, foreign or invalid file is refused with a ValueError that names it.
"""

from __future__ import annotations

import io
import json

import numpy as np
import torch

from .io import atomic_path, read_npz
from .mixture import Mixture

FORMAT_VERSION = 1
ARRAYS = ("weights", "means", "covariances")


def write_model(path, mixture: Mixture, meta: dict, online_state: dict | None = None) -> None:
    arrays = {key: getattr(mixture, key).detach().cpu().numpy() for key in ARRAYS}
    if online_state is not None:
        buffer = io.BytesIO()
        torch.save(online_state, buffer)
        arrays["online_state"] = np.frombuffer(buffer.getvalue(), dtype=np.uint8)
    meta = {"format_version": FORMAT_VERSION, **meta, "online_state": online_state is not None}
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, **arrays, meta=np.array(json.dumps(meta)))


def read_online_state(path, device) -> dict:
    """The running state of ``partial_fit`` that a model file holds (see the module)."""
    not_ours = f"{path} is not a model written by XDGMM.save"
    raw = read_npz(path, ("online_state",), not_ours)["online_state"]
    if raw.dtype != np.uint8:
        raise ValueError(f"{path}: its online_state must be bytes (uint8), got {raw.dtype}")
    try:
        return torch.load(io.BytesIO(raw.tobytes()), map_location=device, weights_only=True)
    except Exception as err:  # torch raises several kinds for damaged or foreign bytes
        raise ValueError(f"{path}: its online_state cannot be read ({err.__class__.__name__})") from None


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

"""The model file ``XDGMM.save`` writes: one ``.npz`` of float arrays (weights, means, covariances) and a JSON
``meta`` string (format version, settings, history), and, for a model that ``partial_fit`` is still
training, ``online_state``: the running state as ``torch.save`` bytes, read back with
``torch.load(weights_only=True)``, which admits tensors and plain data only. It is read without unpickling
anything, and a damaged, foreign or invalid file is refused with a ValueError that names it: ``meta``
carries the SHA-256 of every array's bytes (format 2), checked before any is used.
"""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import torch

from .files import atomic_path, read_npz
from .mixture import Mixture

FORMAT_VERSION = 2  # 1: no checksum (still read)
ARRAYS = ("weights", "means", "covariances")


def checksum(arrays: dict) -> str:
    """SHA-256 over the arrays' names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode() + array.tobytes())
    return digest.hexdigest()


def write_model(path, mixture: Mixture, meta: dict, online_state: dict | None = None) -> None:
    arrays = {key: getattr(mixture, key).detach().cpu().numpy() for key in ARRAYS}
    if online_state is not None:
        buffer = io.BytesIO()
        torch.save(online_state, buffer)
        arrays["online_state"] = np.frombuffer(buffer.getvalue(), dtype=np.uint8)
    meta = {"format_version": FORMAT_VERSION, **meta, "online_state": online_state is not None}
    meta["sha256"] = checksum(arrays)
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, **arrays, meta=np.array(json.dumps(meta)))


def read_online_state(path, device) -> dict:
    """The running state of ``partial_fit`` that a model file holds (see the module)."""
    not_ours = f"{path} is not a model written by XDGMM.save"
    arrays = read_npz(path, (*ARRAYS, "online_state", "meta"), not_ours)
    _verified(path, arrays, _meta(path, arrays.pop("meta"), not_ours))
    raw = arrays["online_state"]
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
    meta = _meta(path, arrays.pop("meta"), not_ours)
    if meta.get("online_state"):  # the checksum covers the running state too
        arrays["online_state"] = read_npz(path, ("online_state",), not_ours)["online_state"]
    _verified(path, arrays, meta)
    arrays.pop("online_state", None)
    if any(a.dtype.kind != "f" for a in arrays.values()):
        raise ValueError(f"{path}: weights, means and covariances must be floating-point arrays")
    mixture = Mixture(*(torch.as_tensor(arrays[key], dtype=torch.float64) for key in ARRAYS))
    mixture.check(f"model {path}")
    return mixture, meta


def _meta(path, raw, not_ours: str) -> dict:
    """The file's meta dictionary, of a format this version reads."""
    try:
        meta = json.loads(str(raw))
    except ValueError as err:
        raise ValueError(
            f"{not_ours}: it is empty, truncated or of another format ({err.__class__.__name__})"
        ) from None
    if not isinstance(meta, dict) or meta.get("format_version") not in (1, FORMAT_VERSION):
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise ValueError(f"{path}: unsupported model format version {version!r} (this version reads {FORMAT_VERSION})")
    return meta


def _verified(path, arrays: dict, meta: dict) -> None:
    """Refuse arrays whose checksum differs from the one written with them (format 1 files have none)."""
    if meta["format_version"] >= 2 and checksum(arrays) != meta.get("sha256"):
        raise ValueError(f"{path} is damaged: its arrays do not match the checksum written with them")

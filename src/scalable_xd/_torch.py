"""Device, dtype and thread settings shared by the estimator, the fit loop, the k-means init and the CLI."""

from __future__ import annotations

from contextlib import contextmanager

import torch

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_device(device: str | torch.device) -> torch.device:
    """Turn ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:1"`` into a usable device, or say why not."""
    if isinstance(device, torch.device):
        name = str(device)
    elif isinstance(device, str):
        name = device
    else:
        raise ValueError(f"device must be a string such as 'auto', 'cpu' or 'cuda', got {device!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"unknown device {name!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'") from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available here; use device='auto' or 'cpu'")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported: use 'auto', 'cpu' or 'cuda'")
    return resolved


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept ``"float32"``/``"float64"`` or the matching torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}[dtype]


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so that wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def one_thread(when: bool = True):
    """torch's CPU work on this thread alone inside the block (``when``): for loops of small tensors, where
    a thread pool gains little and its threads spin on a core after every parallel region, which on a
    shared machine takes the core from the work itself."""
    before = torch.get_num_threads()
    if when:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)

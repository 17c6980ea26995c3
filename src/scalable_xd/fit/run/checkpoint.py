"""Checkpoints: a fit's state after an epoch, written atomically and bound to the fit that wrote it.

``Checkpoint`` is what the estimator and the loop use: opened once, it gives the saved seed and state,
builds the fit's fingerprint and refuses a mismatch (``bind``), and writes after each epoch (``save``).

A checkpoint holds only tensors and plain data (numbers, strings, lists, dicts): the fitter's parameters
and optimiser state, the history so far, and a fingerprint of the fit. It is read with
``torch.load(weights_only=True)``, which refuses anything else, so a file planted at the checkpoint path
cannot run code. The state is stored as bytes beside their SHA-256, checked before they are read, so a
damaged file is refused rather than resumed into a wrong model; the resumed fitter's state is then checked
as a whole (``check_state``: every tensor finite, a valid mixture of the fit's shape). The fingerprint
records the settings, the shapes, the seed and a digest of the data (``data_digest``), and a checkpoint
whose fingerprint differs from the fit's is refused with the differences named, never resumed.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import zipfile
from pathlib import Path

import numpy as np
import torch

from ...data.source import DataSource
from ...errors import brief
from ...files import atomic_path

# Version of the layout; 2: minibatch EM stores its unregularised running state; 3: bound to the data;
# 4: written inside an epoch too (the batches of the epoch in progress already done, and their seconds);
# 5: SGD keeps its own Adam state (step count on the host) rather than torch.optim.Adam's; 6: the state as
# checksummed bytes (``ENVELOPE``), the regularisation per feature; 7: an epoch in progress's seconds as
# (wall, CPU), the history's entries with their CPU seconds.
FORMAT = 7
ENVELOPE = ("sha256", "payload")
KEYS = ("format", "fingerprint", "epoch", "history", "converged", "fitter", "batch", "epoch_seconds")
# Rows of a data set hashed in full by ``data_digest``, evenly spaced over the set.
DIGEST_ROWS = 64
# Fingerprint entries that describe the data rather than the settings.
DATA_KEYS = {"n", "d", "D", "data", "val_data", "init"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: unreadable, from another version, or from another fit."""


def data_digest(data) -> str:
    """A short hash of a data set (in memory or streamed): its shapes, the float64 column sums of X,
    ``DIGEST_ROWS`` evenly spaced rows in full and every sample weight (see ``digest_bytes``). One pass over
    X; any change to X's values, to the sampled rows' noise or to the row order of the sample changes it."""
    n = len(data)
    digest = hashlib.sha256(repr((n, data.obs_dim, data.model_dim)).encode())
    rows = torch.from_numpy(np.unique(np.linspace(0, n - 1, min(n, DIGEST_ROWS)).astype(np.int64)))
    for part in data.digest_bytes(rows):
        digest.update(part)
    return digest.hexdigest()[:16]


def array_digest(*arrays) -> str:
    """A short hash of some optional arrays (the explicit initial parameters): their shapes and float64 values."""
    digest = hashlib.sha256()
    for array in arrays:
        value = None if array is None else np.ascontiguousarray(np.asarray(array, dtype=np.float64))
        digest.update(b"none" if value is None else repr(value.shape).encode() + value.tobytes())
    return digest.hexdigest()[:16]


def save(
    path: Path,
    *,
    fingerprint: dict,
    epoch: int,
    history: list,
    converged: bool,
    fitter_state: dict,
    batch: int = 0,
    epoch_seconds: list[float] | None = None,
) -> None:
    """``epoch``: the last epoch completed; ``batch``: the batches of the next one already done (0 at an
    epoch's end), which took ``epoch_seconds`` (wall, CPU)."""
    state = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "epoch": epoch,
        "history": history,
        "converged": converged,
        "fitter": fitter_state,
        "batch": batch,
        "epoch_seconds": list(epoch_seconds or (0.0, 0.0)),
    }
    write_state(path, state)


def write_state(path, state: dict) -> None:
    """``state`` written atomically as bytes beside their SHA-256 (``ENVELOPE``), which ``load`` checks."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    envelope = {
        "sha256": hashlib.sha256(payload).hexdigest(),
        "payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8),
    }
    with atomic_path(path) as tmp:
        torch.save(envelope, tmp)


def load(path, device="cpu") -> dict:
    """Read a checkpoint without unpickling code; a file that is not one of ours raises CheckpointError
    naming it and saying what to do."""
    path = Path(path)
    fresh = f"delete {path} to start the fit afresh"
    try:
        envelope = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(envelope, dict) or set(envelope) != set(ENVELOPE):
            raise CheckpointError(
                f"checkpoint {path} is not a scalable-xd checkpoint of format {FORMAT} (no checksummed state); {fresh}"
            )
        payload = envelope["payload"].numpy().tobytes()
        if hashlib.sha256(payload).hexdigest() != envelope["sha256"]:
            raise CheckpointError(f"checkpoint {path} is damaged: its state does not match its checksum; {fresh}")
        state = torch.load(io.BytesIO(payload), map_location=device, weights_only=True)
    except (FileNotFoundError, CheckpointError):
        raise
    except pickle.UnpicklingError as err:
        # torch's message advises weights_only=False, which is exactly what must not be done; keep the cause.
        blocked = [line.strip() for line in str(err).splitlines() if "GLOBAL" in line]
        if not blocked:
            raise CheckpointError(f"checkpoint {path} is empty, truncated or not a checkpoint; {fresh}") from None
        raise CheckpointError(
            f"checkpoint {path} holds objects other than tensors and plain data, which are never loaded "
            f"({blocked[0]}); {fresh}"
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path} is empty, truncated or not a checkpoint ({err.__class__.__name__}); {fresh}"
        ) from None
    if not isinstance(state, dict) or not set(KEYS) <= set(state):
        raise CheckpointError(f"checkpoint {path} is not a scalable-xd checkpoint (keys missing); {fresh}")
    if state["format"] != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {state['format']}, this version of scalable-xd reads format {FORMAT}; "
            f"{fresh}"
        )
    return state


def tensor_shapes(state) -> dict[str, tuple]:
    """{where: shape} of every tensor in a nested state, ``where`` its keys and indices joined by dots."""
    return {where: tuple(tensor.shape) for where, tensor in _tensors(state)}


def check_state(fitter, expected: dict[str, tuple], what: str, advice: str) -> None:
    """Refuse (``CheckpointError``: ``what`` holds ...; ``advice``) a resumed state that is not a fit's: a
    tensor of another shape than this fit's own state has (``expected``, its ``tensor_shapes`` before
    loading, where it has one), a non-finite value anywhere, or a model that is not a valid mixture (a
    checksum vouches for the bytes, not for what wrote them)."""
    state = fitter.state_dict()
    shapes = tensor_shapes(state)
    for where, shape in sorted(expected.items()):  # an empty or absent part of a fresh state is not known yet
        if 0 not in shape and shapes.get(where) != shape:
            raise CheckpointError(
                f"{what} holds a state whose {where} has shape {shapes.get(where)}, where this fit's has "
                f"{shape}; {advice}"
            )
    for where, tensor in _tensors(state):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{what} holds a state whose {where} has NaN or inf; {advice}")
    for mixture in (fitter.mixture, fitter.result):
        try:
            mixture.check(what)
        except ValueError as err:
            raise CheckpointError(f"{err}; {advice}") from None


def _tensors(state, prefix: str = ""):
    """(where, tensor) for every tensor in a nested state, as ``tensor_shapes`` names them."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
        return
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    for key, value in items:
        yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))


def check_matches(state: dict, fingerprint: dict, path) -> None:
    """Raise CheckpointError naming every difference between a checkpoint's fit and this one."""
    saved = state["fingerprint"]
    differing = [key for key in sorted(set(saved) | set(fingerprint)) if saved.get(key) != fingerprint.get(key)]
    if differing:
        what = "other data" if DATA_KEYS & set(differing) else "other settings"
        differing.sort(key=lambda key: len(repr(saved.get(key))))  # the short, telling ones (K, a setting) first
        details = "; ".join(
            f"{key} {brief(saved.get(key))} in the checkpoint, {brief(fingerprint.get(key))} now" for key in differing
        )
        raise CheckpointError(
            f"checkpoint {path} was written by a different fit ({what}: {details}); "
            "delete it or choose another checkpoint path to start fresh"
        )


class Checkpoint:
    """One fit's checkpoint file: ``saved`` is its state (None when the file does not exist yet)."""

    def __init__(self, path, device="cpu"):
        self.path = Path(path)
        self.saved = load(self.path, device) if self.path.exists() else None
        self.fingerprint: dict | None = None

    @property
    def seed(self) -> int | None:
        """The seed the checkpointed fit used (so that a fit without random_state resumes it), or None."""
        return None if self.saved is None else self.saved["fingerprint"].get("seed")

    def bind(
        self, settings: dict, seed: int, train: DataSource, train_digest: str, val: DataSource | None, init_arrays=()
    ) -> None:
        """Fingerprint this fit (settings, seed, shapes, digests of the data, ``train_digest`` being
        ``data_digest(train)``, and of explicit initial arrays) and refuse a saved state from any other fit."""
        self.fingerprint = {
            **settings,
            "seed": seed,
            "n": len(train),
            "d": train.obs_dim,
            "D": train.model_dim,
            "data": train_digest,
            "val_data": None if val is None else data_digest(val),
            "init": array_digest(*init_arrays),
        }
        if self.saved is not None:
            check_matches(self.saved, self.fingerprint, self.path)

    def save(
        self,
        epoch: int,
        history: list,
        converged: bool,
        fitter_state: dict,
        batch: int = 0,
        epoch_seconds: list[float] | None = None,
    ) -> None:
        if self.fingerprint is None:
            raise RuntimeError(f"checkpoint {self.path}: bind it to its fit before saving")
        save(
            self.path,
            fingerprint=self.fingerprint,
            epoch=epoch,
            history=history,
            converged=converged,
            fitter_state=fitter_state,
            batch=batch,
            epoch_seconds=epoch_seconds,
        )

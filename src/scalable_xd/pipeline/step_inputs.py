"""What the DAG's steps share: outputs probed before the work starts, k-means init files read and checked,
torch's threads set."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..files import read_npz


def check_writable(*paths) -> None:
    """Fail before the work, not after it, when an output cannot be written (by creating and removing a
    file beside each)."""
    for path in filter(None, paths):
        parent = Path(path).parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=parent):
                pass
        except OSError as err:
            raise OSError(
                f"cannot write {path}: {parent} is not a writable directory ({err.strerror or err})"
            ) from None


def read_init(path, n_components: int, n_features: int | None = None) -> dict:
    """The arrays of a k-means init file (``kmeans``), checked to hold ``n_components`` components (of
    ``n_features`` features, where given); a ValueError names the file otherwise."""
    init = read_npz(
        path, ("weights", "means", "seconds"), f"{path} is not an init file written by `scalable-xd kmeans`"
    )
    if len(init["weights"]) != n_components:
        raise ValueError(f"{path} holds an init of K = {len(init['weights'])} components, not {n_components}")
    means = init["means"]
    if n_features is not None and (means.ndim != 2 or means.shape[1] != n_features):
        raise ValueError(
            f"{path} holds means of shape {means.shape}, not ({n_components}, {n_features}) for these data"
        )
    return init


def set_threads(threads: int) -> None:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)

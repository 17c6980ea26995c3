"""One GPU per concurrent job on a machine with several.

Snakemake's local scheduler limits how many GPU jobs run at once (the ``gpu`` resource) but does not say
which GPU each gets (snakemake/snakemake#281), so every job asking for ``cuda`` would land on ``cuda:0``.
A command-line job given ``--device cuda`` (or ``auto``, with CUDA present) therefore claims a slot:
the lowest-numbered lock file in a per-user folder that no other process holds (``fcntl.flock``), and
runs on GPU ``slot mod n_gpus``. The lock is held until the process exits, however it exits (the kernel
releases it), so a crashed job never keeps its GPU. With at most as many jobs as GPUs each job gets its
own GPU; with more (several fits sharing each GPU, to fill it at small batches) they spread evenly.
Data-parallel fits under torchrun keep their ``cuda:LOCAL_RANK``, and ``cuda:N`` is taken as given.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

_held: list[int] = []  # descriptors of the slots this process holds, open until it exits


def slot_folder() -> Path:
    """The lock files of this user's jobs that see the same GPUs (the same CUDA_VISIBLE_DEVICES)."""
    visible = hashlib.sha1(os.environ.get("CUDA_VISIBLE_DEVICES", "all").encode()).hexdigest()[:8]
    return Path(tempfile.gettempdir()) / f"scalable_xd-{os.getuid()}-gpu-slots-{visible}"


def claim_slot(folder: Path) -> int:
    """The lowest slot no other holder has, now held by this process until it exits."""
    folder.mkdir(parents=True, exist_ok=True)
    slot = 0
    while True:
        fd = os.open(folder / f"slot{slot}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            slot += 1
            continue
        _held.append(fd)
        return slot


def job_device(requested: str) -> str:
    """The device a command-line job runs on: a GPU of its own for ``cuda`` or ``auto`` where several are
    visible (see the module); ``requested`` unchanged otherwise."""
    import torch

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if requested not in ("cuda", "auto") or distributed or not torch.cuda.is_available():
        return requested
    n_gpus = torch.cuda.device_count()
    if n_gpus < 2:
        return requested
    slot = claim_slot(slot_folder())
    device = f"cuda:{slot % n_gpus}"
    log.info("this job runs on %s (slot %d; %d GPUs visible)", device, slot, n_gpus)
    return device

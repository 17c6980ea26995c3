"""Data-parallel fitting over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPUs).

Every global batch is split into P contiguous shares, one per process; each process runs the statistics
pass on its share, and one ``all_reduce`` sums the shares' statistics, after which every process holds the
global batch's sums and applies the same update, so the parameters stay identical everywhere. Batch EM
reduces per chunk of a pass, minibatch EM per minibatch, SGD the same sums its gradients are made of;
evaluation passes reduce their log-likelihood totals. The result equals the one-process fit on the same
global batches up to the order of float summation (tested in float64 to 1e-9).

One reduction carries one flat float64 tensor: n, q (K), U (K D), the upper triangles of UU and P
(K D (D + 1) / 2 each) and the log-likelihood, so K (1 + D + D (D + 1)) + 2 numbers a step, plus K^2 + 2K
when the split-and-merge criteria ride along. A process that dies makes the others' next reduction fail
(gloo reports the closed connection; otherwise the group's timeout bounds the wait: ``process_group``'s
``timeout``, 600 s by default and ``scalable-xd fit --group-timeout``; a group a user initialises has the
one given to ``init_process_group``, 30 minutes by torch's default for gloo), which ``reduce_statistics``
turns into a ``RuntimeError`` naming the rank and the timeout. A process whose own inputs fail their
checks tells the others before any other exchange (``fail_together``), and every input and setting the
processes must share is then compared in one exchange (``check_same_fit``), so either fails them all at
once with its name.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ... import deferred_checks
from ...errors import brief
from ...kernel.statistics import Criteria, Statistics, symmetric_from_triangle


@dataclass(frozen=True)
class Group:
    """This process's place in the group: ``rank`` of ``size`` (0 of 1 when not distributed)."""

    rank: int = 0
    size: int = 1

    @classmethod
    def current(cls) -> Group:
        """The initialised default process group, or a group of one."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def parallel(self) -> bool:
        return self.size > 1

    @property
    def writes(self) -> bool:
        """Whether this process writes checkpoints and outputs (rank 0 alone)."""
        return self.rank == 0

    def share(self, index, length: int):
        """This process's contiguous share of a batch's rows ``index`` (a slice or an index tensor)."""
        if not self.parallel:
            return index
        bounds = [length * r // self.size for r in range(self.size + 1)]
        start, stop = bounds[self.rank], bounds[self.rank + 1]
        if isinstance(index, slice):
            return slice(index.start + start, index.start + stop)
        return index[start:stop]


ONE_PROCESS = Group()


def check_same_fit(group: Group, fit: dict) -> None:
    """Every process of ``group`` was given the same fit: ``fit`` (what identifies it: rows, a digest of the
    data, the settings, the seed) is compared across the processes, and a difference is one ValueError on
    every process, naming the ranks and what differs, before any work that would fail obscurely (gloo's
    size mismatch) or silently (one model per rank)."""
    if not group.parallel:
        return
    everyone: list[dict] = [{}] * group.size  # filled by the gather
    with _collective(group):
        dist.all_gather_object(everyone, fit)
    differing = [key for key in fit if len({json.dumps(each[key], sort_keys=True) for each in everyone}) > 1]
    if differing:
        details = "; ".join(
            f"{key}: " + ", ".join(f"rank {rank} {brief(each[key])}" for rank, each in enumerate(everyone))
            for key in differing
        )
        raise ValueError(
            f"rank {group.rank} of {group.size}: the processes of this data-parallel fit were given different "
            f"{', '.join(differing)} ({details}); every process must fit the same data with the same settings"
        )


def shared_seed(group: Group, seed: int) -> int:
    """Rank 0's ``seed`` on every process (a fit without random_state draws one per process)."""
    if not group.parallel:
        return seed
    shared = [seed]
    with _collective(group):
        dist.broadcast_object_list(shared, src=0)
    return shared[0]


GROUP_TIMEOUT = 600.0  # seconds a process waits for the others in one collective (``process_group``)


@contextlib.contextmanager
def process_group(device: str, timeout: float = GROUP_TIMEOUT):
    """Under torchrun (WORLD_SIZE > 1 in the environment) join the process group for the block: NCCL with
    one GPU per process where the fit runs on CUDA, gloo on CPU; yields the device this process fits on.
    The group is destroyed on the way out: a process that exits with it alive can abort in gloo's threads
    ("terminate called without an active exception") while the others are still writing."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield device
        return
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout))
    try:
        yield device
    finally:
        if joined:
            dist.destroy_process_group()


def _upper(a: torch.Tensor) -> torch.Tensor:
    rows, cols = torch.triu_indices(a.shape[-1], a.shape[-1], device=a.device)
    return a[..., rows, cols]


def reduce_statistics(stats: Statistics, group: Group, with_criteria: bool = False) -> Statistics:
    """The sum of every process's ``stats`` (identical on every process afterwards), in float64."""
    if not group.parallel:
        return stats
    k, d = stats.U.shape
    if stats.loglik is None or (with_criteria and stats.criteria is None):
        raise ValueError(
            "reduce_statistics: a fit's statistics carry their log-likelihood (and the criteria asked for)"
        )
    parts = [
        _as_vector(stats.n_points, stats.q.device),
        stats.q,
        stats.U,
        _upper(stats.UU),
        _upper(stats.P),
        stats.loglik.reshape(1),
    ]
    if with_criteria and stats.criteria is not None:
        c = stats.criteria
        parts += [c.overlap, c.r_log_r, c.r_log_n]
    with_background = stats.background is not None  # the same on every process: a setting of the fit
    if stats.background is not None:
        parts.append(stats.background.reshape(1))
    flat = torch.cat([p.reshape(-1).double() for p in parts])
    _all_reduce(flat, group)
    sizes = [1, k, k * d, k * d * (d + 1) // 2, k * d * (d + 1) // 2, 1] + ([k * k, k, k] if with_criteria else [])
    sizes += [1] if with_background else []
    n, q, U, UU, P, loglik, *rest = torch.split(flat, sizes)
    background = rest.pop()[0] if with_background else None
    criteria = Criteria(rest[0].reshape(k, k), rest[1], rest[2]) if rest else None
    return Statistics(
        n[0] if deferred_checks.active() is not None else float(n),
        q,
        U.reshape(k, d),
        symmetric_from_triangle(UU.reshape(k, -1), d, lower=False),
        symmetric_from_triangle(P.reshape(k, -1), d, lower=False),
        loglik[0],
        criteria,
        background,
    )


def _as_vector(n: float | torch.Tensor, device) -> torch.Tensor:
    """``n`` as a (1,) float64 tensor on ``device``: a number is filled in there, not copied from the host."""
    if torch.is_tensor(n):
        return n.to(torch.float64).reshape(1)
    return torch.full((1,), float(n), dtype=torch.float64, device=device)


def reduce_sum(value: float, group: Group, device) -> float:
    """A float summed over the processes (the evaluation passes' log-likelihood totals)."""
    if not group.parallel:
        return value
    total = torch.tensor([value], dtype=torch.float64, device=device)
    _all_reduce(total, group)
    return float(total[0])


def _all_reduce(tensor: torch.Tensor, group: Group) -> None:
    with _collective(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


@contextlib.contextmanager
def _collective(group: Group):
    """A collective whose failure (a process gone, the timeout passed) is a RuntimeError naming the rank and
    the timeout, not gloo's bare "Timed out" or "Connection closed by peer"."""
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as err:
        timeout = group_timeout()
        waited = "the group's timeout" + ("" if timeout is None else f", {timeout:g} s")
        raise RuntimeError(
            f"rank {group.rank} of {group.size}: lost contact with the other processes of the fit (one of them "
            f"failed, was killed or waited longer than {waited}): {err}"
        ) from None


def group_timeout() -> float | None:
    """Seconds a collective of the default group waits, whoever made the group (``process_group`` or the
    user's ``init_process_group``), as its backend holds them; None where this torch does not say."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        return pg._get_backend(pg._device_types[0]).options._timeout.total_seconds()
    except (AttributeError, IndexError, RuntimeError, ValueError):
        return None


@contextlib.contextmanager
def fail_together(group: Group, stage: str):
    """Run ``stage`` (what each process does alone before the fit's first exchange: checking its inputs,
    opening its checkpoint) and then tell every process whether any failed, so that an error on one rank
    (NaN in its data, say) is the same error on all of them, naming the rank, instead of a lost contact
    on the others. A process fails with ValueError where the failing rank's error was one, else
    RuntimeError. One exchange of a few bytes; nothing at all outside a data-parallel fit."""
    if not group.parallel:
        yield
        return
    failure: tuple[str, bool, str] | None = None  # (kind, whether a ValueError, message)
    raised: Exception | None = None
    try:
        yield
    except Exception as err:  # any: shared with the other processes, then raised again
        failure = (type(err).__name__, isinstance(err, ValueError), str(err))
        raised = err
    everyone: list[tuple[str, bool, str] | None] = [None] * group.size
    try:
        with _collective(group):
            dist.all_gather_object(everyone, failure)
    except RuntimeError:
        if raised is not None:  # the others are gone: this process's own error says more than a lost contact
            raise raised from None
        raise
    failed = [(rank, each) for rank, each in enumerate(everyone) if each is not None]
    if not failed:
        return
    ranks = [rank for rank, _ in failed]
    where = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    reasons = "; ".join(f"rank {rank}: {kind}: {message}" for rank, (kind, _, message) in failed)
    error = ValueError if failed[0][1][1] else RuntimeError
    raise error(
        f"rank {group.rank} of {group.size}: {stage} failed on {where}, so no process of this data-parallel "
        f"fit starts it ({reasons})"
    ) from raised

"""Where one minibatch update's time goes: ``torch.profiler`` over a few minibatch-EM updates (statistics pass
and float64 update), as JSON in benchmarks/results/.

    python benchmarks/profile_batch.py --device cuda --n-components 512 --batch-size 500
    python benchmarks/profile_batch.py                     # CPU, K = 64 (a quick check that it runs)

``--step graphed`` profiles the step a GPU fit replays as a CUDA graph (``fit/engines/cuda.py``: static
buffers, checks deferred, online EM's update as one Triton kernel on CUDA), run eagerly so that the profiler
sees each of its kernels; ``--step ordinary`` (the default) the uncaptured step, ``fitter.observe``;
``--step evaluation`` one scoring of ``--batch-size`` points as a fit scores its validation data after every
epoch (``fit.run.scoring.total_loglik``, the data held on the device: ``Dataset.resident``), each "update" one
such scoring.

Reported per update: wall seconds, the number of device kernels launched (CUDA) or operators run, the
host-device synchronisations (``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``aten::item``/
``aten::is_nonzero``, each a stall of the CPU), the 15 most expensive operators by self time, and on CUDA
every kernel with its device time (``kernels``; their sum, ``kernel_device_ms``, against the wall time
says whether the device's work or the gaps between kernels set the pace).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, machine, parse_args, write_result  # noqa: E402
from bench_fit import synthetic  # noqa: E402

from scalable_xd import deferred_checks  # noqa: E402
from scalable_xd._torch import resolve_device, synchronize  # noqa: E402
from scalable_xd.data.batching import Batch  # noqa: E402
from scalable_xd.data.dataset import Dataset  # noqa: E402
from scalable_xd.fit.engines.cuda import GRAPHED, GraphedStep  # noqa: E402
from scalable_xd.fit.families.minibatch_em import MinibatchEM  # noqa: E402
from scalable_xd.fit.run.scoring import total_loglik  # noqa: E402
from scalable_xd.kernel.dispatch import batch_statistics  # noqa: E402

SYNCS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "aten::item",
    "aten::is_nonzero",
    "aten::_local_scalar_dense",
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n-components", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "unrolled", "compiled", "linalg"])
    parser.add_argument("--step", default="ordinary", choices=["ordinary", "graphed", "evaluation"])
    args = parse_args(parser, argv, n_components=4, updates=2)
    device, dtype = resolve_device(args.device), getattr(torch, args.dtype)
    x, S, mixture = synthetic(args.batch_size * (args.updates + 1), args.n_components, dtype)
    x, S = x.to(device), S.to(device)
    fitter = MinibatchEM(
        mixture.to(device, torch.float64),
        w=1e-3,
        step_size=0.01,
        schedule="step",
        step_decay=0.5,
        decay_epoch=10,
        kappa=0.6,
        covariance_update="stable",
    )

    def update(i: int) -> None:
        rows = slice(i * args.batch_size, (i + 1) * args.batch_size)
        fitter.observe(batch_statistics(x[rows], S[rows], fitter.mixture, backend=args.backend))

    stack = contextlib.ExitStack()
    if args.step == "graphed":
        graphed = GraphedStep(GRAPHED[fitter.rule](fitter), device, args.backend)
        graphed.capturing = False  # the body a graph replays, run eagerly: the profiler sees every kernel
        stack.enter_context(deferred_checks.deferring(device, graphed.checks))

        def update(i: int) -> None:  # noqa: F811
            rows = slice(i * args.batch_size, (i + 1) * args.batch_size)
            assert graphed.step(Batch(args.batch_size, x[rows], S[rows], None, None), None)

    if args.step == "evaluation":
        host = Dataset(x[: args.batch_size].cpu().double(), S[: args.batch_size].cpu().double(), validate=False)
        held = host.resident(device, dtype)

        def update(i: int) -> None:  # noqa: F811
            total_loglik(held, fitter.mixture, device, dtype, args.backend)

    update(0)  # warm-up (and the compile of a compiled backend)
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    tick = time.perf_counter()
    with profile(activities=activities) as prof:
        for i in range(1, args.updates + 1):
            update(i)
        synchronize(device)
    seconds = (time.perf_counter() - tick) / args.updates
    stack.close()
    events = prof.key_averages()
    on_device = sorted(
        (e for e in events if e.device_type.name == "CUDA"), key=lambda e: e.self_device_time_total, reverse=True
    )
    kernels = sum(e.count for e in on_device) if device.type == "cuda" else None
    operators = sum(e.count for e in events if e.key.startswith("aten::"))
    syncs = {e.key: e.count / args.updates for e in events if e.key in SYNCS}
    top = sorted(events, key=lambda e: e.self_cpu_time_total + getattr(e, "self_device_time_total", 0), reverse=True)
    result = {
        "machine": machine(),
        "device": device_name(device),
        "K": args.n_components,
        "batch": args.batch_size,
        "dtype": args.dtype,
        "backend": args.backend,
        "step": args.step,
        "seconds_per_update": seconds,
        "kernels_per_update": None if kernels is None else kernels / args.updates,
        "operators_per_update": operators / args.updates,
        "syncs_per_update": syncs,
        "kernel_device_ms": sum(e.self_device_time_total for e in on_device) / 1e3 / args.updates,
        "kernels": [
            {
                "name": e.key[:100],
                "count_per_update": e.count / args.updates,
                "device_ms": e.self_device_time_total / 1e3 / args.updates,
            }
            for e in on_device
        ],
        "top_operators": [
            {
                "name": e.key,
                "count_per_update": e.count / args.updates,
                "self_cpu_ms": e.self_cpu_time_total / 1e3 / args.updates,
                "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3 / args.updates,
            }
            for e in top[:15]
        ],
    }
    print({k: v for k, v in result.items() if k not in ("machine", "top_operators", "kernels")})
    for kernel in result["kernels"][:12]:
        print(f"  {kernel['device_ms'] * 1e3:9.1f} us  x{kernel['count_per_update']:g}  {kernel['name']}")
    suffix = "" if args.step == "ordinary" else f"_{args.step}"
    write_result(f"profile_batch_{device.type}_K{args.n_components}_b{args.batch_size}{suffix}", result)


if __name__ == "__main__":
    main()

"""Speed of the statistics pass and of whole fitting epochs; writes JSON to benchmarks/results/.

    python benchmarks/bench_fit.py                      # CPU, float32 and float64, N = 100,000, K = 64
    python benchmarks/bench_fit.py --device cuda --n-components 64 512 --batch-sizes 500 50000

Throughput is (point, component) pairs per second of the per-batch statistics pass (q, U, UU, P and the
log-likelihood), for each kernel backend: ``fused`` (numba, CPU only; its first call, the compile or the
load from numba's cache, is reported apart), ``unrolled`` (the eager torch path), ``compiled`` (the same
code through torch.compile; its first call, the compile, is reported apart), ``linalg`` (batched LAPACK calls,
the first implementation) and ``reference``, the straightforward PyTorch formulation the paper's equations
suggest: form T_ij, b_ij and B_ij for every pair with batched inverses, then sum r b and r (b b^T + B).
``--max-pairs`` times the pass cut into chunks of several sizes ((point, component) pairs a chunk,
``dispatch.chunks``; default: each backend's own, ``kernel.TABLE``), one row each; ``--deferred-checks``
times it with its per-chunk tests deferred, as a fit's epochs run it (``deferred_checks``: no chunk waits
for the device to say whether a pair failed to factorise).
Achieved flop/s count the arithmetic the unrolled pass performs per pair (``flops_per_pair``), set against
the FP32 peak where it is known (``--peak-tflops``, or the table below for GPUs).
Epoch times are training seconds per epoch of each method with each kernel (evaluation passes
excluded), from given initial parameters (no k-means), at batch 500 as in the paper; the kernel is forced
by replacing the estimator's choice (``kernel.dispatch.fit_backend``).
Every figure is the best of several runs: the development VMs share their cores, and single timings vary
by 20-30%.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scalable_xd import XDGMM, deferred_checks
from scalable_xd._torch import resolve_device, synchronize
from scalable_xd.kernel.dispatch import batch_statistics
from scalable_xd.kernel.unrolled import unrolled_terms
from scalable_xd.mixture import Mixture

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, forced_kernel, machine, parse_args, write_result  # noqa: E402

D = 7
# Dense FP32 (non-tensor-core) peaks from the vendors' data sheets, TFLOP/s.
FP32_PEAK_TFLOPS = {"H100 80GB HBM3": 66.9, "H100 PCIe": 51.2, "H100 NVL": 60.0, "H200": 66.9, "A100": 19.5}


def reference_statistics(x, S, mixture: Mixture):
    """Eq. 4-5 of the paper, per pair: r_ij, b_ij (B, K, D), B_ij (B, K, D, D) and their weighted sums."""
    V, m = mixture.covariances, mixture.means
    T = V.unsqueeze(0) + S.unsqueeze(1)
    T_inv = torch.linalg.inv(T)
    diff = x.unsqueeze(1) - m.unsqueeze(0)
    u = (T_inv @ diff.unsqueeze(-1)).squeeze(-1)
    log_dens = mixture.log_weights - 0.5 * (torch.logdet(T) + (diff * u).sum(-1) + D * np.log(2 * np.pi))
    resp = torch.softmax(log_dens, dim=1)
    b = m + (V @ u.unsqueeze(-1)).squeeze(-1)
    B = V - V @ T_inv @ V
    sum_b = torch.einsum("bk,bkd->kd", resp, b)
    sum_bb = torch.einsum("bk,bkde->kde", resp, b.unsqueeze(-1) * b.unsqueeze(-2) + B)
    return resp.sum(0), sum_b, sum_bb, torch.logsumexp(log_dens, dim=1)


class _FlopCounter(TorchDispatchMode):
    """Arithmetic of every op a function dispatches: elementwise ops count one per output element (addcmul
    two; sign flips and comparisons none), reductions one per input element (logsumexp three), bmm 2mnk."""

    ELEMENTWISE = {
        "add": 1,
        "sub": 1,
        "mul": 1,
        "div": 1,
        "addcmul": 2,
        "sqrt": 1,
        "reciprocal": 1,
        "exp": 1,
        "log": 1,
        "pow": 1,
    }
    REDUCTIONS = {"sum": 1, "logsumexp": 3}

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__.rstrip("_")
        if name in self.ELEMENTWISE:
            self.flops += self.ELEMENTWISE[name] * out.numel()
        elif name in self.REDUCTIONS:
            self.flops += self.REDUCTIONS[name] * args[0].numel()
        elif name == "bmm":
            (batch, m, k), n = args[0].shape, args[1].shape[-1]
            self.flops += 2 * batch * m * n * k
        return out


def flops_per_pair() -> float:
    """Floating-point operations of the unrolled pass (statistics and log-likelihood) per pair; every op
    is elementwise over the pairs or sums over them, so the count does not depend on K or the batch."""
    x, S, mixture = synthetic(256, 16, torch.float64)
    counter = _FlopCounter()
    with counter:
        unrolled_terms(
            x.T.contiguous(),
            S.permute(1, 2, 0).contiguous(),
            mixture.log_weights,
            mixture.means,
            mixture.covariances,
            True,
        )
    return counter.flops / (256 * 16)


def synthetic(n: int, k: int, dtype, seed: int = 0):
    """Gaia-sized problem: 7-D points, per-point full noise covariances, a K-component mixture."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=gen, dtype=torch.float64) * 3
    a = torch.randn(n, D, D, generator=gen, dtype=torch.float64) * 0.3
    S = a @ a.mT + 0.05 * torch.eye(D, dtype=torch.float64)
    b = torch.randn(k, D, D, generator=gen, dtype=torch.float64)
    V = b @ b.mT / D + torch.eye(D, dtype=torch.float64)
    mixture = Mixture(
        torch.full((k,), 1.0 / k, dtype=torch.float64), torch.randn(k, D, generator=gen, dtype=torch.float64) * 3, V
    )
    return x.to(dtype), S.to(dtype), mixture.to(dtype=dtype)


def pairs_per_second(fn, x, S, mixture, batch: int, device, repeats: int) -> tuple[float, float]:
    """(best pairs/s, seconds of the first call: warm-up, or the compile of a compiled kernel)."""
    xb, Sb, mix = x[:batch].to(device), S[:batch].to(device), mixture.to(device)
    tick = time.perf_counter()
    fn(xb, Sb, mix)
    synchronize(device)
    first = time.perf_counter() - tick
    best = float("inf")
    for _ in range(repeats):
        tick = time.perf_counter()
        fn(xb, Sb, mix)
        synchronize(device)
        best = min(best, time.perf_counter() - tick)
    return batch * mixture.n_components / best, first


def timed_pass(backend: str, max_pairs: int | None, deferred: bool, device):
    """``batch_statistics`` on ``backend`` in chunks of ``max_pairs``, its tests deferred where asked."""

    def run(x, S, mixture):
        with deferred_checks.deferring(device) if deferred else contextlib.nullcontext():
            return batch_statistics(x, S, mixture, backend=backend, max_pairs=max_pairs)

    return run


def epoch_seconds(method: str, x, S, mixture: Mixture, device, dtype_name: str, epochs: int, kernel: str) -> float:
    """Training seconds of the fastest of ``epochs`` epochs (this VM's neighbours make single runs noisy)."""
    with forced_kernel(kernel):
        model = XDGMM(
            mixture.n_components,
            method,
            epochs=epochs,
            tol=None,
            device=str(device),
            dtype=dtype_name,
            random_state=0,
            weights_init=mixture.weights.double().numpy(),
            means_init=mixture.means.double().numpy(),
            covariances_init=mixture.covariances.double().numpy(),
        ).fit(x, Xcov=S)
    return float(np.diff([entry["seconds"] for entry in model.history_]).min())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--n-components", type=int, nargs="+", default=[64])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[500])
    parser.add_argument("--epochs", type=int, default=3, help="epochs per method; the fastest is reported")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats of the pass; the fastest is reported")
    parser.add_argument("--skip-epochs", action="store_true", help="measure the statistics pass only")
    parser.add_argument("--peak-tflops", type=float, default=None, help="FP32 peak of the device, TFLOP/s")
    parser.add_argument("--label", default=None, help="suffix of the output file name")
    parser.add_argument(
        "--max-pairs", type=int, nargs="+", default=[None], help="pairs a chunk of the pass (default: the backend's)"
    )
    parser.add_argument("--deferred-checks", action="store_true", help="defer the pass's tests as fits do")
    parser.add_argument("--skip-baselines", action="store_true", help="time neither linalg nor the reference")
    parser.add_argument(
        "--kernels", nargs="+", default=None, help="backends timed (default: fused or triton, unrolled, compiled)"
    )
    args = parse_args(
        parser, argv, n=3000, n_components=[4], dtypes=["float32"], epochs=1, repeats=2, kernels=["fused", "unrolled"]
    )

    device = resolve_device(args.device)
    name = device_name(device)
    peak = args.peak_tflops or next((v for key, v in FP32_PEAK_TFLOPS.items() if key in name), None)
    flops = flops_per_pair()
    kernels = tuple(args.kernels or ("fused" if device.type == "cpu" else "triton", "unrolled", "compiled"))
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for k in args.n_components:
            x, S, mixture = synthetic(args.n, k, dtype)
            for batch, max_pairs in itertools.product(args.batch_sizes, args.max_pairs):
                row = {"dtype": dtype_name, "K": k, "D": D, "N": args.n, "batch": batch, "flops_per_pair": flops}
                row |= {"max_pairs": max_pairs, "checks": "deferred" if args.deferred_checks else "at each chunk"}
                for backend in kernels + (() if args.skip_baselines else ("linalg",)):
                    run = timed_pass(backend, max_pairs, args.deferred_checks, device)
                    rate, first = pairs_per_second(run, x, S, mixture, batch, device, args.repeats)
                    row[f"{backend}_pairs_per_s"] = rate
                    row[f"{backend}_gflop_per_s"] = rate * flops / 1e9
                    if peak is not None:
                        row[f"{backend}_fraction_of_fp32_peak"] = row[f"{backend}_gflop_per_s"] / (peak * 1e3)
                    if backend in ("fused", "compiled"):
                        row[f"{backend}_first_call_s"] = first
                if not args.skip_baselines:
                    ref_batch = min(batch, max(1, (1 << 16) // k))  # the reference holds (B, K, D, D) several times
                    row["reference_pairs_per_s"], _ = pairs_per_second(
                        reference_statistics, x, S, mixture, ref_batch, device, args.repeats
                    )
                print(json.dumps(row), flush=True)
                rows.append(row)
            if not args.skip_epochs:
                for method in ("em", "minibatch_em", "sgd"):
                    for kernel in kernels:
                        seconds = epoch_seconds(method, x, S, mixture, device, dtype_name, args.epochs, kernel)
                        row = {
                            "dtype": dtype_name,
                            "K": k,
                            "D": D,
                            "N": args.n,
                            "batch": 500,
                            "method": method,
                            "kernel": kernel,
                            "seconds_per_epoch": seconds,
                        }
                        print(json.dumps(row), flush=True)
                        rows.append(row)

    info = {"benchmark": "bench_fit", **machine(), "device": name, "fp32_peak_tflops": peak}
    write_result(f"bench_fit_{device.type}" + (f"_{args.label}" if args.label else ""), {**info, "results": rows})


if __name__ == "__main__":
    main()

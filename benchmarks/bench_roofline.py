"""The CPU statistics pass against the machine's own peak, at every D: pairs/s and flop/s of the compiled pass
(``fused``) beside the rate of torch's matrix multiply (sgemm, dgemm) measured in the same process on the same
threads; writes JSON to benchmarks/results/.

    python benchmarks/bench_roofline.py                         # D = 2, 3, 7, 12, 20, 32; float32 and float64
    python benchmarks/bench_roofline.py --dims 7 --noise dense  # one D, one noise form

Each row times one pass of ``batch_statistics`` (the sums q, U, UU, P and the log-likelihood: a batch-EM
iteration without its M-step) over N points and K components, best of ``--repeats``, after a first call that
compiles the kernel or loads it from numba's cache (reported apart as ``first_call_seconds``). The flops a pair
are counted as D^3 + 6 D^2 + 20 D: the Cholesky factor of T = V + S (D^3 / 3 multiply-adds, so D^3 / 3 x 2),
the inverse from the factor (D^3 / 3 x 2) and its weighted sum (D^2), the solve, u u^T and the sums in O(D^2),
and the O(D) rest; at D = 7 that is 777, close to the 745 ``bench_fit.flops_per_pair`` counts in the unrolled
torch source. Below D = 3 the exp and log a pair, which the count leaves out, dominate: compare pairs/s there.
``share_of_gemm`` is the pass's flop rate over the matrix multiply's in the same dtype: the fraction of what
this machine's cores do at best. Run it on a quiet machine (stop any long run first): the pass and the
multiply share the cores with whatever else runs, and ``machine_load`` (psutil) records what did.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from scalable_xd.kernel.dispatch import batch_statistics
from scalable_xd.mixture import Mixture

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import first_and_best, machine, parse_args, write_result  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def flops_per_pair(dim: int) -> int:
    """The pass's floating-point operations a pair at dimension ``dim`` (see the module)."""
    return dim**3 + 6 * dim**2 + 20 * dim


def gemm_flops_per_second(dtype: torch.dtype, size: int, repeats: int) -> float:
    """Best flop/s of torch's square matrix multiply (``size`` x ``size``) on this process's threads."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen, dtype=dtype) for _ in range(2))
    out = torch.empty(size, size, dtype=dtype)
    _, best = first_and_best(lambda: torch.mm(a, b, out=out), repeats)
    return 2 * size**3 / best


def problem(n: int, k: int, dim: int, noise: str, dtype: torch.dtype, seed: int = 0):
    """N points in ``dim`` dimensions with per-point noise (``diagonal``: (N, D) variances; ``dense``: (N, D, D)
    covariances), and a K-component mixture whose components overlap the points."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, (n, dim))
    if noise == "diagonal":
        S = rng.uniform(0.05, 1.0, (n, dim))
    else:
        a = rng.normal(0, 0.3, (n, dim, dim))
        S = a @ a.transpose(0, 2, 1) + 0.05 * np.eye(dim)
    b = rng.normal(0, 1, (k, dim, dim))
    V = b @ b.transpose(0, 2, 1) / dim + np.eye(dim)
    mixture = Mixture(torch.full((k,), 1.0 / k), torch.from_numpy(rng.normal(0, 3, (k, dim))), torch.from_numpy(V))
    return torch.from_numpy(x).to(dtype), torch.from_numpy(S).to(dtype), mixture.to(dtype=dtype)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[2, 3, 7, 12, 20, 32])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "float64"])
    parser.add_argument("--noise", nargs="+", choices=["diagonal", "dense"], default=["diagonal", "dense"])
    parser.add_argument("--n-components", type=int, default=64)
    parser.add_argument(
        "--pairs", type=float, default=4e6, help="N x K a pass at D = 7; N scales as 7^3 / D^3 (default 4e6)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gemm-size", type=int, default=2048)
    args = parse_args(parser, argv, dims=[2, 3], pairs=2e4, repeats=1, gemm_size=256)
    wall, cpu, busy = time.perf_counter(), time.process_time(), _machine_busy_seconds()
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        gemm = gemm_flops_per_second(dtype, args.gemm_size, args.repeats)
        for dim in args.dims:
            n = max(int(args.pairs * min(1.0, 7**3 / dim**3) / args.n_components), 100)
            for noise in args.noise:
                x, S, mixture = problem(n, args.n_components, dim, noise, dtype)
                # the first call compiles the kernel for this (D, dtype, noise form) or loads it from numba's cache
                first, seconds = first_and_best(
                    functools.partial(batch_statistics, x, S, mixture, backend="fused"), args.repeats
                )
                pairs = n * args.n_components / seconds
                flops = pairs * flops_per_pair(dim)
                row = {"dtype": dtype_name, "D": dim, "noise": noise, "N": n, "K": args.n_components}
                row |= {"pairs_per_second": pairs, "gflop_per_s": flops / 1e9, "gemm_gflop_per_s": gemm / 1e9}
                row |= {"share_of_gemm": flops / gemm, "first_call_seconds": first}
                rows.append(row)
                print(
                    f"{dtype_name} D={dim:2d} {noise:8s}: {pairs / 1e6:8.2f} M pairs/s, {flops / 1e9:6.1f} GFLOP/s,"
                    f" {100 * flops / gemm:5.1f}% of gemm's {gemm / 1e9:.0f}"
                )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    others = (_machine_busy_seconds() - busy - cpu) / wall  # cores the rest of the machine kept busy
    info = {"benchmark": "bench_roofline", **machine(), "machine_load": max(others, 0.0), "rows": rows}
    info["cpu_flags"] = sorted({"avx2", "avx512f", "fma"} & set(_cpu_flags()))
    write_result("bench_roofline_cpu", info)


def _machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy, every process and core, since boot."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def _cpu_flags() -> list[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; none elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return line.split(":", 1)[-1].split()


if __name__ == "__main__":
    main()

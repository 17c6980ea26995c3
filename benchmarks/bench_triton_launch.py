"""How the Triton pass's launch shape sets its two kernels' speed; writes JSON to benchmarks/results/.

    python benchmarks/bench_triton_launch.py --device cuda          # K = 512, 50,000 stars, float32

For each (stars per program, warps per program), the densities kernel and the sums kernel of
``kernel/triton_pass.py`` alone, on the same inputs: the best of ``--repeats`` timed pairs of launches,
in ms and pairs per second, with the registers a thread uses and the spills where Triton reports them.
``triton_pass.BLOCK`` and ``triton_pass.NUM_WARPS`` are chosen from this table. Beside them
(``combine``), the log-sum-exp kernel at its tile (``COMBINE_ROWS`` x ``COMBINE_STARS``), against
``torch.logsumexp`` over the same (K, N) array, which it replaced. On the CPU it runs
through Triton's interpreter (``TRITON_INTERPRET=1``): a check that it runs, not a timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, machine, parse_args, write_result  # noqa: E402
from bench_fit import synthetic  # noqa: E402

from scalable_xd._torch import resolve_device, synchronize  # noqa: E402

SHAPES = [(128, 4), (128, 2), (128, 8), (128, 1), (256, 4), (256, 8), (64, 2), (64, 1)]


def best_ms(launch, device, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        tick = time.perf_counter()
        launch()
        launch()
        synchronize(device)
        best = min(best, (time.perf_counter() - tick) / 2)
    return best * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n-rows", type=int, default=50_000)
    parser.add_argument("--n-components", type=int, default=512)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parse_args(parser, argv, device="cpu", n_rows=200, n_components=3, repeats=1)
    import triton

    from scalable_xd.kernel import triton_pass

    device, dtype = resolve_device(args.device), getattr(torch, args.dtype)
    n, k = args.n_rows, args.n_components
    x, S, mixture = synthetic(n, k, dtype)
    dim = x.shape[1]
    x, S, mixture = x.to(device), S.to(device), mixture.to(device, torch.float64)
    densities, sums, combine = triton_pass.kernels(dim)
    xt, st = x.T.contiguous(), S.reshape(n, dim * dim).T.contiguous()
    par = triton_pass._parameters(*mixture.tensors(), dtype)
    dens = torch.empty((k, n), dtype=dtype, device=device)
    failed = torch.empty((k, n), dtype=torch.int8, device=device)
    log_resp = torch.log(torch.rand((k, n), dtype=dtype, device=device))  # the sums kernel's log densities
    loglik = torch.zeros(n, dtype=dtype, device=device)  # about a log-likelihood of 0: responsibilities in (0, 1)
    rows = []
    for block, warps in SHAPES[:1] if args.quick else SHAPES:
        grid = (k, triton.cdiv(n, block))
        partial = torch.empty((grid[1], k, triton_pass.n_sums(dim)), dtype=dtype, device=device)
        launches = {
            "densities": lambda g=grid, b=block, w=warps: densities[g](
                xt, st, par, dens, failed, n, n, k, BLOCK=b, num_warps=w
            ),
            "sums": lambda g=grid, b=block, w=warps, p=partial: sums[g](
                xt, st, par, log_resp, loglik, loglik, p, n, n, k, k, WEIGHTED=False, BLOCK=b, num_warps=w
            ),
        }
        row = {"block": block, "warps": warps}
        for name, launch in launches.items():
            compiled = launch()  # the compile, and the registers it reports
            synchronize(device)
            row[f"{name}_regs"] = getattr(compiled, "n_regs", None)
            row[f"{name}_spills"] = getattr(compiled, "n_spills", None)
            row[f"{name}_ms"] = best_ms(launch, device, args.repeats)
            row[f"{name}_pairs_per_s"] = n * k / (row[f"{name}_ms"] / 1e3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    timed = {
        "combine_ms": lambda: triton_pass.log_likelihoods(combine, log_resp, 1),
        "torch_logsumexp_ms": lambda: torch.logsumexp(log_resp, dim=0),
    }
    combined = {"rows": triton_pass.COMBINE_ROWS, "stars": triton_pass.COMBINE_STARS}
    for name, launch in timed.items():
        launch()  # the compile
        combined[name] = best_ms(launch, device, args.repeats)
    print(json.dumps(combined), flush=True)
    info = {
        "benchmark": "bench_triton_launch",
        **machine(),
        "device": device_name(device),
        "triton": triton.__version__,
    }
    sizes = {"N": n, "K": k, "D": dim, "dtype": args.dtype}
    write_result(f"bench_triton_launch_{device.type}", {**info, **sizes, "results": rows, "combine": combined})


if __name__ == "__main__":
    main()

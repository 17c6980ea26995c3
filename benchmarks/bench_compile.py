"""The fused CPU kernel's first-use compile time, and its pass speed after, per dimension D; writes JSON.

    python benchmarks/bench_compile.py                        # D = 2, 7, 12, 20, 32, as the library builds it
    python benchmarks/bench_compile.py --unrolled-up-to 99    # every D unrolled (the kernel before the bound)

Each D runs in its own process with an empty kernel cache. ``first_fit_s`` is what a new user's first fit
waits: a whole minibatch-EM fit (K = 16, 10,000 stars, two epochs, float32), with numba compiling the
kernels it uses (serial statistics for its steps, multi-threaded densities for its evaluation). Then
``first_call_s`` is one pass (K = 64, 2,000 stars) that compiles the multi-threaded statistics kernel,
and ``pairs_per_s`` the pass's speed after, best of ``--repeats``. A process that outlives ``--timeout`` is
recorded as such (its compile time is at least that).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402

ONE_D = """
import json, sys, time
import numpy as np, torch
from scalable_xd.kernel import fused_layout
from scalable_xd.kernel.dispatch import batch_statistics
from scalable_xd.mixture import Mixture
dim, bound, k, n, repeats = (int(a) for a in sys.argv[1:6])
if bound >= 0:
    fused_layout.UNROLLED_MAX_DIM = bound
rng = np.random.default_rng(0)
a = rng.normal(size=(k, dim, dim))
mixture = Mixture(torch.full((k,), 1.0 / k, dtype=torch.float64), torch.tensor(rng.normal(size=(k, dim))),
                  torch.tensor(a @ a.transpose(0, 2, 1) + np.eye(dim)))
x = torch.tensor(rng.normal(size=(n, dim)), dtype=torch.float32)
S = torch.eye(dim, dtype=torch.float32).expand(n, dim, dim).contiguous() * 0.1
from scalable_xd import XDGMM
tick = time.perf_counter()
XDGMM(16, "minibatch_em", epochs=2, random_state=0).fit(np.tile(x.numpy(), (5, 1)), Xcov=np.tile(S.numpy(), (5, 1, 1)))
first_fit = time.perf_counter() - tick
tick = time.perf_counter()
batch_statistics(x, S, mixture, backend="fused")
first = time.perf_counter() - tick
best = float("inf")
for _ in range(repeats):
    tick = time.perf_counter()
    batch_statistics(x, S, mixture, backend="fused")
    best = min(best, time.perf_counter() - tick)
print(json.dumps({"D": dim, "looped": dim > fused_layout.UNROLLED_MAX_DIM, "first_fit_s": round(first_fit, 2),
                  "first_call_s": round(first, 2),
                  "pairs_per_s": round(n * k / best)}))
"""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=[2, 7, 12, 20, 32])
    parser.add_argument("--unrolled-up-to", type=int, default=-1, help="the bound to use (default: the library's)")
    parser.add_argument("--n-components", type=int, default=64)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--label", default=None, help="suffix of the output file name")
    args = parse_args(parser, argv, dims=[2], n_components=4, n=200, repeats=1)
    rows = []
    for dim in args.dims:
        with tempfile.TemporaryDirectory() as cache:
            command = [sys.executable, "-c", ONE_D, str(dim), str(args.unrolled_up_to), str(args.n_components)]
            command += [str(args.n), str(args.repeats)]
            try:
                done = subprocess.run(
                    command,
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                    env={**os.environ, "SCALABLE_XD_CACHE": cache},
                    check=True,
                )
                row = json.loads(done.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                row = {"D": dim, "first_call_s": f"> {args.timeout:g}", "pairs_per_s": None}
        print(json.dumps(row), flush=True)
        rows.append(row)
    info = {"benchmark": "bench_compile", **machine(), "K": args.n_components, "n": args.n, "dtype": "float32"}
    info["unrolled_up_to"] = "library default" if args.unrolled_up_to < 0 else args.unrolled_up_to
    write_result("bench_compile_cpu" + (f"_{args.label}" if args.label else ""), {**info, "results": rows})


if __name__ == "__main__":
    main()

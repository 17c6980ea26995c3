"""Data-parallel throughput: the same fit with P = 1 and P = 2 processes (gloo on CPU, NCCL on GPUs), and
what one step sends; writes JSON to benchmarks/results/.

    python benchmarks/bench_parallel.py                       # CPU: N = 100,000, K = 64, 2 epochs per method
    python benchmarks/bench_parallel.py --n-components 64 512

Each process gets cores / P torch threads, so P = 2 on a 2-core machine compares one process using both
cores with two processes using one each: it measures the cost of the reductions (and of Python's per-batch
overhead spread over two processes), not a speed-up from more hardware. The bytes per step are those of
``fit.run.parallel.reduce_statistics``: K (1 + D + D (D + 1)) + 2 float64 numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402

WORKER = """
import json, os, sys, time
import numpy as np, torch, torch.distributed as dist
from scalable_xd import XDGMM
n, k, method, epochs, threads = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")
rng = np.random.default_rng(0)
x = rng.normal(size=(n, 7)) * 3
S = rng.uniform(0.01, 0.1, size=(n, 7))
means = x[rng.choice(n, k, replace=False)]
model = XDGMM(k, method, epochs=epochs, batch_size=500, tol=None, device="cpu", random_state=0, means_init=means)
model.fit(x, Xcov=S)
if not dist.is_initialized() or dist.get_rank() == 0:
    print(json.dumps({"seconds_per_epoch": model.history_[-1]["seconds"] / epochs}))
if dist.is_initialized():
    dist.destroy_process_group()  # else gloo's threads may abort the process at exit
"""


def run(processes: int, n: int, k: int, method: str, epochs: int) -> float:
    """Seconds per training epoch (evaluation excluded) with ``processes`` processes."""
    threads = max(1, (os.cpu_count() or 1) // processes)
    args = [str(n), str(k), method, str(epochs), str(threads)]
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "worker.py"
        script.write_text(WORKER)
        command = [sys.executable, str(script), *args]
        if processes > 1:
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(processes),
                str(script),
                *args,
            ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{' '.join(command[:6])} ... failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds_per_epoch"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--n-components", type=int, nargs="+", default=[64])
    parser.add_argument("--methods", nargs="+", default=["em", "minibatch_em", "sgd"])
    parser.add_argument("--epochs", type=int, default=2)
    args = parse_args(parser, argv, n=3000, n_components=[4], epochs=1, methods=["minibatch_em"])
    rows = []
    for k in args.n_components:
        for method in args.methods:
            tick = time.perf_counter()
            one, two = run(1, args.n, k, method, args.epochs), run(2, args.n, k, method, args.epochs)
            numbers = k * (1 + 7 + 7 * 8) + 2
            rows.append(
                {
                    "K": k,
                    "method": method,
                    "P1_seconds_per_epoch": one,
                    "P2_seconds_per_epoch": two,
                    "numbers_per_step": numbers,
                    "bytes_per_step": 8 * numbers,
                    "wall_seconds": time.perf_counter() - tick,
                }
            )
            print(rows[-1], flush=True)
    write_result("bench_parallel_cpu", {"machine": machine(), "n": args.n, "epochs": args.epochs, "results": rows})


if __name__ == "__main__":
    main()

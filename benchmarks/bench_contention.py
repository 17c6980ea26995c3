"""How a fit slows down when another process competes for the CPU; writes JSON to benchmarks/results/.

    python benchmarks/bench_contention.py            # demo-sized fits: 80,000 stars, K = 32, 64, 128, D = 7
    GOMP_SPINCOUNT=300000 python benchmarks/...      # with GNU OpenMP's own spin count

For each K, a minibatch-EM and an SGD fit (two epochs, batch 500, float32) are timed quiet, then beside
one CPU-bound process per ``--competitors`` (a Python loop that never sleeps), best of ``--rounds`` runs
each. A fit on a
shared machine should slow down in proportion to the CPU it gets: with one competitor on two cores, at most
about 2x (the issue's target is 2.5x). A thread pool whose threads wait for a descheduled sibling at every
small parallel region slows down far more; ``cpu_s`` (the process's CPU time) shows the difference between
waiting and working.

The package sets GNU OpenMP's spin count (``GOMP_SPINCOUNT``, see ``scalable_xd/__init__.py``) where it
is unset; OpenMP reads it when it loads, so a script that imports torch first keeps torch's pool at the
default 300,000 spins (``--torch-first`` measures that case).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

if "--torch-first" in sys.argv:  # as a script that imports torch before scalable_xd does
    import torch

from scalable_xd import XDGMM  # first, as the command line does: it sets GOMP_SPINCOUNT before OpenMP loads

# isort: split
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402
from bench_fit import synthetic  # noqa: E402


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def _time_fit(method: str, x, S, k: int, rounds: int) -> dict:
    best = None
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        XDGMM(k, method, epochs=2, device="cpu", random_state=0, tol=None).fit(x, Xcov=S)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if best is None or wall < best["wall_s"]:
            best = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=80_000)
    p.add_argument("--n-components", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--competitors", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--name", default="bench_contention_cpu")
    p.add_argument("--torch-first", action="store_true", help="import torch before scalable_xd (see module)")
    args = parse_args(p, argv, n=2000, n_components=[4], rounds=1)
    results = {}
    for k in args.n_components:
        x, S, _ = synthetic(args.n, k, torch.float64)
        x, S = x.numpy(), S.numpy()
        XDGMM(k, "sgd", epochs=1, device="cpu", random_state=0, tol=None).fit(x[:2000], Xcov=S[:2000])  # compile
        for method in ("minibatch_em", "sgd"):
            quiet = _time_fit(method, x, S, k, args.rounds)
            stop = multiprocessing.Event()
            spinners = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(args.competitors)]
            for spinner in spinners:
                spinner.start()
            try:
                loaded = _time_fit(method, x, S, k, args.rounds)
            finally:
                stop.set()
                for spinner in spinners:
                    spinner.join()
            slowdown = round(loaded["wall_s"] / quiet["wall_s"], 2)
            results[f"K={k} {method}"] = {"quiet": quiet, "loaded": loaded, "slowdown": slowdown}
            print(f"K={k}", method, results[f"K={k} {method}"], flush=True)
    write_result(
        args.name,
        {
            "machine": machine(),
            "n": args.n,
            "competitors": args.competitors,
            "torch_imported_first": args.torch_first,
            "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
            "epochs": 2,
            "results": results,
            "numpy": np.__version__,
        },
    )


if __name__ == "__main__":
    main()

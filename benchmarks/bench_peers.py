"""Peers timed in the same run as ours, on the same data and initial parameters; writes JSON to results/.
The documentation's peer figures (docs/performance.md) come from this script only.

    python benchmarks/bench_peers.py                  # N = 100,000, D = 7, K = 64

Peers are timed when importable, installed by the user from their public sources (never vendored here):

* Bovy et al.'s ``extreme_deconvolution`` (C with OpenMP; https://github.com/jobovy/extreme-deconvolution:
  build it as its README says, or compile ``src/*.c`` with ``-fopenmp -fcommon -lgsl -lgslcblas`` into
  ``py/_extreme_deconvolution.so`` and put ``py``'s parent on PYTHONPATH as the package
  ``extreme_deconvolution``): batch EM, seconds an iteration, from the same initial parameters, and its
  log-likelihood beside ours as a check that both did the same work.
* The paper's ``deconv`` package (``pip install git+https://github.com/bayesiains/density-deconvolution``):
  minibatch EM (``OnlineDeconvGMM``) and SGD (``SGDDeconvGMM``) at batch 500, seconds an epoch as the
  difference between fits of two epochs and of one (it initialises itself with its own k-means, the same
  in both fits, so the difference is one epoch with its scoring; the cost of an epoch does not depend on
  where it starts).

Ours: wall seconds a batch-EM iteration including the scoring of every iterate (``fit`` of 3 epochs,
less its k-means-free set-up), and wall seconds an epoch of minibatch EM and SGD including the scoring
of every epoch, for float32 and float64, with the fused (numba) kernel and torch.compile's. Threads:
torch's and OpenMP's are reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import forced_kernel, machine, parse_args, write_result  # noqa: E402
from bench_fit import synthetic  # noqa: E402

from scalable_xd import XDGMM  # noqa: E402

W = 1e-3  # Bovy's w: the same regularisation in both


def _problem(n: int, k: int):
    x, S, mixture = synthetic(n, k, torch.float64)
    init = {
        "weights_init": mixture.weights.numpy(),
        "means_init": mixture.means.numpy(),
        "covariances_init": mixture.covariances.numpy(),
    }
    return x.numpy(), S.numpy(), init


def ours(x, S, init, method: str, epochs: int, dtype: str, kernel: str) -> dict:
    """Wall seconds per epoch (iteration) with every iterate scored, the training seconds per epoch, and
    the last mean log-likelihood. A one-epoch fit first pays the compile (cached for the timed fit)."""
    settings = dict(
        n_components=len(init["weights_init"]),
        method=method,
        tol=None,
        w=W,
        dtype=dtype,
        device="cpu",
        random_state=0,
        batch_size=500,
        **init,
    )
    with forced_kernel(kernel):
        XDGMM(**{**settings, "epochs": 1}).fit(x[:5000], Xcov=S[:5000])
        tick = time.perf_counter()
        model = XDGMM(**{**settings, "epochs": epochs}).fit(x, Xcov=S)
        wall = time.perf_counter() - tick
    seconds = np.diff([h["seconds"] for h in model.history_])
    return {
        "wall_seconds_per_epoch": wall / epochs,
        "train_seconds_per_epoch": float(seconds.mean()),
        "loglik_by_epoch": [h["train_loglik"] for h in model.history_],
    }


def bovy(x, S, init, iterations: int) -> dict | None:
    if importlib.util.find_spec("extreme_deconvolution") is None:
        return None
    from extreme_deconvolution import extreme_deconvolution

    amp, mean, covar = (np.array(init[k], dtype=np.float64) for k in ("weights_init", "means_init", "covariances_init"))
    tick = time.perf_counter()
    # its loop runs while the improvement exceeds tol, starting from 2 tol: a tiny positive tol runs every
    # iteration of an EM that improves (a negative one would run none)
    loglik = extreme_deconvolution(x, S, amp, mean, covar, tol=1e-300, maxiter=iterations, w=W)
    wall = time.perf_counter() - tick
    # Bovy's average log-likelihood is of the parameters its last E-step started from
    return {
        "wall_seconds_per_epoch": wall / iterations,
        "loglik_of_iteration": iterations - 1,
        "loglik": float(loglik),
        "omp_threads": int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())),
    }


def paper(x, S, k: int) -> dict | None:
    if importlib.util.find_spec("deconv") is None:
        return None
    from deconv.gmm.online_deconv_gmm import OnlineDeconvGMM
    from deconv.gmm.sgd_deconv_gmm import SGDDeconvDataset, SGDDeconvGMM

    data = SGDDeconvDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(S, dtype=torch.float32))
    out = {}
    for name, cls in (("minibatch_em", OnlineDeconvGMM), ("sgd", SGDDeconvGMM)):
        walls = []
        for epochs in (1, 2):
            torch.manual_seed(0)
            model = cls(k, x.shape[1], epochs=epochs, batch_size=500, device=torch.device("cpu"))
            tick = time.perf_counter()
            model.fit(data)
            walls.append(time.perf_counter() - tick)
        out[name] = {"wall_seconds_per_epoch": walls[1] - walls[0]}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--n-components", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=3, help="batch-EM iterations timed (each peer and ours)")
    parser.add_argument("--ours-only", action="store_true", help="skip the peers (a before/after of our code)")
    parser.add_argument("--label", default=None, help="suffix of the output file name")
    parser.add_argument("--kernels", nargs="+", default=["fused", "compiled"], help="our backends timed")
    args = parse_args(parser, argv, n=3000, n_components=4, iterations=1, ours_only=True, kernels=["fused"])

    x, S, init = _problem(args.n, args.n_components)
    result = {
        "benchmark": "bench_peers",
        **machine(),
        "N": args.n,
        "K": args.n_components,
        "D": x.shape[1],
        "batch": 500,
        "w": W,
        "ours": {},
    }
    for dtype in ("float32", "float64"):
        for kernel in args.kernels:
            name = f"{dtype}_{kernel}"
            result["ours"][name] = {
                method: ours(x, S, init, method, args.iterations if method == "em" else 2, dtype, kernel)
                for method in ("em", "minibatch_em", "sgd")
            }
            print(name, result["ours"][name], flush=True)
    result["bovy"] = None if args.ours_only else bovy(x, S, init, args.iterations)
    print("bovy", result["bovy"], flush=True)
    result["paper"] = None if args.ours_only else paper(x, S, args.n_components)
    print("paper", result["paper"], flush=True)
    ratios = {}
    for name, timings in result["ours"].items():
        if result["bovy"]:
            ratios[f"bovy_em_over_{name}_em"] = (
                result["bovy"]["wall_seconds_per_epoch"] / timings["em"]["wall_seconds_per_epoch"]
            )
        for method in ("minibatch_em", "sgd"):
            if result["paper"]:
                peer = result["paper"][method]["wall_seconds_per_epoch"]
                ratios[f"paper_{method}_over_{name}_{method}"] = peer / timings[method]["wall_seconds_per_epoch"]
    result["ratios"] = ratios
    write_result("bench_peers_cpu" + (f"_{args.label}" if args.label else ""), result)


if __name__ == "__main__":
    main()

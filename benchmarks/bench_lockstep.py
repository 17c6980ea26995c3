"""What S starts in lockstep cost against one fit (``n_init``, ``fit/run/lockstep.py``); writes JSON to
benchmarks/results/.

    python benchmarks/bench_lockstep.py                 # CPU, 50,000 stars, D = 7, K = 16 and 64, batch 500
    python benchmarks/bench_lockstep.py --device cuda --n 200000 --k 64 512 --epochs 2 --train-score-rows 10000

For each minibatch method, whole fits of ``--epochs`` epochs with ``n_init`` = 1 and ``n_init`` =
``--starts``, each the best of ``--rounds``: ``ratio``, the ensemble's time over one fit's (S fits one after
another would be S), and ``per_start_s``, the ensemble's time over S. Every start begins from the same given
means (no k-means: its cost is per start, and not what lockstep shares), each with its own batch order; a
fit's time includes its data checks, start and scoring of ``train_score_rows`` training rows each epoch
(each start's own sample, by its seed) and of all of them at the end. On CUDA the starts share one
replayed step (``fit.engines.cuda.GraphedEnsemble``) and the final scoring of the training data
(``fit.run.scoring.scores_together``); the JSON is bench_lockstep_<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

from scalable_xd import XDGMM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402
from bench_fit import synthetic  # noqa: E402

METHODS = ("minibatch_em", "sgd")


def fit_seconds(method: str, k: int, n_init: int, epochs: int, data, args) -> float:
    """Wall seconds of one fit of ``n_init`` starts."""
    x, S, mixture = data
    model = XDGMM(
        k,
        method,
        n_init=n_init,
        epochs=epochs,
        tol=None,
        batch_size=args.batch_size,
        dtype="float32",
        random_state=0,
        means_init=mixture.means.double().numpy(),
        device=args.device,
        **({} if args.train_score_rows is None else {"train_score_rows": args.train_score_rows}),
    )
    tick = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short budgets: ConvergenceWarning
        model.fit(x.numpy(), Xcov=S.numpy())
    return time.perf_counter() - tick


def best_seconds(method: str, k: int, n_init: int, data, args) -> float:
    return min(fit_seconds(method, k, n_init, args.epochs, data, args) for _ in range(args.rounds))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--k", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--train-score-rows", type=int, default=None, help="default: the library's")
    args = parse_args(parser, argv, n=3000, k=[8], starts=3, rounds=1, epochs=1, methods=["minibatch_em"])
    rows = []
    for k in args.k:
        data = synthetic(args.n, k, torch.float32)
        for method in args.methods:  # compile every kernel the runs below take
            for n_init in (1, 2):
                fit_seconds(method, k, n_init, 1, data, args)
        for method in args.methods:
            one, together = best_seconds(method, k, 1, data, args), best_seconds(method, k, args.starts, data, args)
            rows.append(
                {
                    "method": method,
                    "n_components": k,
                    "one_fit_s": one,
                    "ensemble_s": together,
                    "per_start_s": together / args.starts,
                    "ratio": together / one,
                }
            )
            print(f"{method} K={k}: one fit {one:.3f} s, {args.starts} starts {together:.3f} s ({together / one:.2f}x)")
    config = {k: v for k, v in vars(args).items() if k != "quick"}
    write_result(
        f"bench_lockstep_{torch.device(args.device).type}", {"machine": machine(), "config": config, "results": rows}
    )


if __name__ == "__main__":
    main()

"""The simulation study of Nguyen, Forbes & McLachlan (2020; section 4.2 of its supplement), run with our XD code:
batch EM against minibatch EM with their learning rate, Polyak averaging and truncation, plus stochastic EM
and split-and-merge.

    python benchmarks/bench_minibatch_study.py --reps 5             # n = 10^6, 5 replications (~15 min on 2 cores)
    python benchmarks/bench_minibatch_study.py --n 100000 --reps 2  # a quick look

Scenarios: ``elki``, the seed's ELKI mixture (3 components in 2-D) observed without noise (XD then reduces to
a plain Gaussian mixture, the seed's setting), and ``elki_noisy``, the same true values observed with
heteroscedastic noise: per star sigma_x, sigma_y ~ U(0.005, 0.05) and correlation ~ U(-0.5, 0.5). ``trap``:
the noisy data from a local optimum (two components in the first cluster, one straddling the others;
``trapped_start``), to see which algorithms leave it (ARI near 1) and which keep it.

Protocol, as the seed's: one random initialisation per replication shared by every algorithm (our reading of
McLachlan & Peel's random start, section 3.9.3: a random subsample of 10 g stars split at random into g
groups, each group's mean and covariance, equal weights), a budget of 10 epochs, minibatches of n/10 and
n/5, learning rate gamma_r = (1 - 1e-10) r^-0.6 (``step_schedule="power"``), truncation with
c1 = c2 = c3 = 1000, no regularisation (w = 0). Metrics, as the seed's: the mean log-likelihood of the
observed data, the squared error of the parameters after the best matching of components (sum over
components of (pi - pi*)^2 + |mu - mu*|^2 + |Sigma - Sigma*|_F^2), the adjusted Rand index of the fitted
labels against the true ones; and ours: the mean log-likelihood of the noise-free true values under the
deconvolved model. Results in benchmarks/results/minibatch_study_<scenario>.json.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.metrics import adjusted_rand_score

from scalable_xd import XDGMM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, parse_args, write_result  # noqa: E402

WEIGHTS = np.array([0.5, 0.3, 0.2])
MEANS = np.array([[0.3, 0.3], [0.85, 0.35], [0.45, 0.85]])
COVARIANCES = np.array([np.diag([0.09**2, 0.09**2]), np.diag([0.05**2, 0.1**2]), np.diag([0.035**2, 0.035**2])])
NFM_STEP = dict(step_schedule="power", step_size=1 - 1e-10, kappa=0.6)


def algorithms(n: int) -> dict[str, dict]:
    """The seed's variants (EM; N = n/10 and n/5, each plain, P(olyak) and T(runcated)) and stochastic EM."""
    variants = {"EM": dict(method="em")}
    for label, batch in (("n/10", n // 10), ("n/5", n // 5)):
        base = dict(method="minibatch_em", batch_size=batch, **NFM_STEP)
        variants[f"mbEM {label}"] = base
        variants[f"mbEM {label} P"] = {**base, "averaging": "polyak"}
        variants[f"mbEM {label} T"] = {**base, "truncation": True}
    variants["SEM"] = dict(method="stochastic_em")
    variants["SEM n/10"] = dict(method="stochastic_minibatch_em", batch_size=n // 10, **NFM_STEP)
    # split-and-merge (docs/design/split-merge.md): batch EM tries moves once it gains < 1e-3 nats/star per
    # iteration (the 10-iteration budget leaves no room for a tighter tolerance); minibatch EM one per
    # other epoch, judged on 20,000 training stars
    variants["EM SM"] = dict(method="em", split_merge=True, tol=1e-3)
    variants["mbEM n/10 SM"] = dict(method="minibatch_em", batch_size=n // 10, split_merge=True, **NFM_STEP)
    return variants


def simulate(n: int, noisy: bool, rng: np.random.Generator):
    """True values, labels, observations and their noise covariances (zero when not ``noisy``)."""
    labels = rng.choice(3, size=n, p=WEIGHTS)
    chol = np.linalg.cholesky(COVARIANCES)
    true = MEANS[labels] + np.einsum("nij,nj->ni", chol[labels], rng.standard_normal((n, 2)))
    if not noisy:
        return true, labels, true, np.zeros((n, 2))
    sx, sy = rng.uniform(0.005, 0.05, n), rng.uniform(0.005, 0.05, n)
    rho = rng.uniform(-0.5, 0.5, n)
    noise = np.stack([np.stack([sx**2, rho * sx * sy], -1), np.stack([rho * sx * sy, sy**2], -1)], -2)
    observed = true + np.einsum("nij,nj->ni", np.linalg.cholesky(noise), rng.standard_normal((n, 2)))
    return true, labels, observed, noise


def random_start(x: np.ndarray, g: int, rng: np.random.Generator) -> dict:
    """A random subsample of 10 g stars, split at random into g groups of 10: their means and covariances."""
    sample = x[rng.choice(len(x), size=10 * g, replace=False)]
    groups = rng.permutation(10 * g).reshape(g, 10)
    means = np.array([sample[idx].mean(0) for idx in groups])
    covs = np.array([np.cov(sample[idx].T) for idx in groups])
    return dict(weights_init=np.full(g, 1.0 / g), means_init=means, covariances_init=covs)


def trapped_start() -> dict:
    """The classic local optimum: two components inside the first cluster, one straddling the other two."""
    means = np.array([MEANS[0] - 0.02, MEANS[0] + 0.02, (MEANS[1] + MEANS[2]) / 2])
    covs = np.array([np.eye(2) * 0.05**2, np.eye(2) * 0.05**2, np.cov(MEANS[1:].T) + np.eye(2) * 0.05**2])
    return dict(weights_init=np.array([0.25, 0.25, 0.5]), means_init=means, covariances_init=covs)


def squared_error(model: XDGMM) -> float:
    """The seed's SE after the best matching of fitted to true components (all 3! orders tried)."""
    best = np.inf
    for order in itertools.permutations(range(3)):
        o = list(order)
        se = (
            np.sum((model.weights_[o] - WEIGHTS) ** 2)
            + np.sum((model.means_[o] - MEANS) ** 2)
            + np.sum((model.covariances_[o] - COVARIANCES) ** 2)
        )
        best = min(best, float(se))
    return best


def run(n: int, reps: int, noisy: bool, seed: int, trapped: bool = False) -> dict:
    rows = []
    for rep in range(reps):
        rng = np.random.default_rng([seed, rep])
        true, labels, x, S = simulate(n, noisy, rng)
        start = trapped_start() if trapped else random_start(x, 3, rng)
        for name, settings in algorithms(n).items():
            base = dict(n_components=3, epochs=10, tol=None, w=0.0, dtype="float64", device="cpu", random_state=rep)
            model = XDGMM(**{**base, **start, **settings})
            tick = time.perf_counter()
            try:
                model.fit(x, Xcov=S)
            except ValueError as err:  # a divergence is a result of the study, not a crash of it
                rows.append({"rep": rep, "algorithm": name, "error": str(err)})
                continue
            rows.append(
                {
                    "rep": rep,
                    "algorithm": name,
                    "seconds": time.perf_counter() - tick,
                    "train_seconds": model.history_[-1]["seconds"],
                    "loglik": model.score(x, Xcov=S),
                    "true_loglik": model.score(true, Xcov=None),
                    "squared_error": squared_error(model),
                    "ari": adjusted_rand_score(labels, model.predict(x, Xcov=S)),
                    "truncation_restarts": model.history_[-1].get("truncation_restarts"),
                    "moves_accepted": model.history_[-1].get("moves_accepted"),
                }
            )
            print(
                f"rep {rep} {name:14s} loglik {rows[-1]['loglik']:.6f} SE {rows[-1]['squared_error']:.2e} "
                f"ARI {rows[-1]['ari']:.4f}",
                flush=True,
            )
    return {"rows": rows, "summary": summarise(rows)}


def summarise(rows: list[dict]) -> dict:
    """Mean and standard deviation over replications of every metric, per algorithm."""
    summary = {}
    for name in dict.fromkeys(r["algorithm"] for r in rows):
        done = [r for r in rows if r["algorithm"] == name and "error" not in r]
        summary[name] = {"failed": sum(1 for r in rows if r["algorithm"] == name and "error" in r)}
        for metric in ("loglik", "true_loglik", "squared_error", "ari", "train_seconds"):
            values = np.array([r[metric] for r in done])
            summary[name][metric] = {"mean": float(values.mean()), "sd": float(values.std())} if len(values) else None
    return summary


def markdown_table(scenarios) -> str:
    """The user guide's table from the written results: mean (sd) over replications per algorithm."""
    import json

    from _common import RESULTS

    lines = []
    for scenario in scenarios:
        result = json.loads((RESULTS / f"minibatch_study_{scenario}.json").read_text())
        lines += [
            f"{scenario} (n = {result['n']:,}, {result['reps']} replications):",
            "",
            "| algorithm | log-likelihood | true-value log-likelihood | SE | ARI | train s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, summary in result["summary"].items():
            cells = [f"{summary[m]['mean']:.4f} ({summary[m]['sd']:.4f})" for m in ("loglik", "true_loglik")]
            cells += [
                f"{summary['squared_error']['mean']:.2e}",
                f"{summary['ari']['mean']:.3f}",
                f"{summary['train_seconds']['mean']:.1f}",
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="print the README's table from written results")
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--scenarios", nargs="+", default=["elki", "elki_noisy", "trap"], choices=["elki", "elki_noisy", "trap"]
    )
    parser.add_argument("--seed", type=int, default=2019)
    args = parse_args(parser, argv, n=3000, reps=1, scenarios=["elki"])
    if args.table:
        print(markdown_table(args.scenarios))
        return
    for scenario in args.scenarios:
        result = run(args.n, args.reps, scenario != "elki", args.seed, trapped=scenario == "trap")
        write_result(
            f"minibatch_study_{scenario}",
            {"machine": machine(), "scenario": scenario, "n": args.n, "reps": args.reps, "seed": args.seed, **result},
        )


if __name__ == "__main__":
    main()

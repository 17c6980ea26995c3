"""One paper-scale fit timed end to end, data loading included; writes JSON to benchmarks/results/.

    python benchmarks/bench_paper_fit.py --device cuda              # 2M mock rows: 1.6M training stars,
                                                                    # K = 512, 20 epochs of minibatch EM
    python benchmarks/bench_paper_fit.py --n-rows 200000 --n-components 64 --epochs 2   # a CPU-sized run

The catalogue is the DR2-like mock turned into the pipeline's feature files (written once to
``benchmarks/scratch/`` and reused; its time is reported as ``prepare_seconds``, outside the fit). The timed
part is what a user's fit costs: reading the train and validation splits from Parquet, the minibatch k-means
init, and the fit with its per-epoch validation passes, with the kernel a fit with ``backend="auto"`` (every
shipped config) gets on the device, or the one ``--kernel`` names. Reported: the phases, the fit's training
seconds per epoch (evaluation excluded, as in the paper's timings), pairs/s over the training passes, the
final log-likelihoods, and where the fit's other seconds go (``evaluation_parts_seconds``: the data's
checks, the starting mixture, the regularisation, the scoring after each epoch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

import scalable_xd.fit.driver
import scalable_xd.fit.loop
import scalable_xd.fit.plan
from scalable_xd import XDGMM
from scalable_xd._torch import resolve_device, synchronize
from scalable_xd.files import atomic_path
from scalable_xd.fit.starts.mixture import kmeans_init
from scalable_xd.kernel.dispatch import fit_backend
from scalable_xd.pipeline.features_file import read_features
from scalable_xd.pipeline.gaia.mock import make_mock
from scalable_xd.pipeline.gaia.storage import write_feature_splits
from scalable_xd.settings import KMeansSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, forced_kernel, machine, parse_args, write_result  # noqa: E402

SCRATCH = Path(__file__).resolve().parent / "scratch"


def prepared_features(n_rows: int) -> tuple[Path, float]:
    """The feature splits of an ``n_rows`` mock, built on first use; (folder, seconds spent building)."""
    folder = SCRATCH / f"mock_n{n_rows}"
    if (folder / "features" / "train.parquet").exists():
        return folder / "features", 0.0
    folder.mkdir(parents=True, exist_ok=True)
    tick = time.perf_counter()
    with atomic_path(folder / "raw.parquet") as tmp:
        make_mock(n_rows, seed=0).to_parquet(tmp, index=False, row_group_size=200_000)
    write_feature_splits(folder / "raw.parquet", folder / "features", progress=False)
    return folder / "features", time.perf_counter() - tick


# The parts of a fit beside its training epochs, each timed where the library calls it: (name, module, function).
PHASES = (
    ("data_checks", scalable_xd.fit.plan, "training_data"),  # reading the arrays in, checking every row
    ("starting_mixture", scalable_xd.fit.driver, "starting_mixture"),  # the covariances about the given means
    ("regularisation", scalable_xd.fit.driver, "regularisation"),
    ("scoring", scalable_xd.fit.loop, "_mean_loglik"),  # every epoch's training sample and validation set
)


@contextlib.contextmanager
def phase_clock(device):
    """Seconds spent in each of ``PHASES``, summed over calls, in the dict it yields."""
    seconds = dict.fromkeys([name for name, _, _ in PHASES], 0.0)
    originals = [(module, function, getattr(module, function)) for _, module, function in PHASES]

    def timed(name, original):
        def run(*args, **kwargs):
            tick = time.perf_counter()
            result = original(*args, **kwargs)
            synchronize(device)
            seconds[name] += time.perf_counter() - tick
            return result

        return run

    for (name, _, _), (module, function, original) in zip(PHASES, originals):
        setattr(module, function, timed(name, original))
    try:
        yield seconds
    finally:
        for module, function, original in originals:
            setattr(module, function, original)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-rows", type=int, default=2_000_000, help="mock catalogue rows (80%% train)")
    parser.add_argument("--n-components", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--method", default="minibatch_em", choices=["em", "minibatch_em", "sgd"])
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--kmeans-epochs", type=int, default=10)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--kernel",
        default="auto",
        choices=["auto", "fused", "triton", "unrolled", "compiled"],
        help="the statistics pass (auto: what a fit with backend='auto' gets on the device)",
    )
    parser.add_argument("--label", default=None, help="suffix of the output file name")
    args = parse_args(parser, argv, n_rows=5000, n_components=4, epochs=2, kmeans_epochs=1, device="cpu")
    device = resolve_device(args.device)

    features, prepare_seconds = prepared_features(args.n_rows)

    start = time.perf_counter()
    train, val = read_features(features / "train.parquet"), read_features(features / "val.parquet")
    load_seconds = time.perf_counter() - start

    tick = time.perf_counter()
    weights, means = kmeans_init(
        torch.as_tensor(train.X),
        args.n_components,
        KMeansSettings(epochs=args.kmeans_epochs, batch_size=args.batch_size),
        0,
        device,
        torch.float32,
    )
    synchronize(device)
    kmeans_seconds = time.perf_counter() - tick

    kernel = fit_backend("auto", device) if args.kernel == "auto" else args.kernel
    tick = time.perf_counter()
    with forced_kernel(kernel), phase_clock(device) as phases:
        model = XDGMM(
            args.n_components,
            args.method,
            batch_size=args.batch_size,
            epochs=args.epochs,
            tol=None,
            device=str(device),
            dtype="float32",
            random_state=0,
            verbose=1,
            weights_init=weights.numpy(),
            means_init=means.numpy(),
        ).fit(train.X, Xcov=train.covariance(), X_val=val.X, Xcov_val=val.covariance())
    fit_seconds = time.perf_counter() - tick
    total_seconds = time.perf_counter() - start

    train_seconds = model.history_[-1]["seconds"]
    row = {
        "n_rows": args.n_rows,
        "n_train": len(train.X),
        "n_val": len(val.X),
        "K": args.n_components,
        "D": 7,
        "method": args.method,
        "epochs": args.epochs,
        "batch": args.batch_size,
        "dtype": "float32",
        "kernel": kernel,
        "prepare_seconds": prepare_seconds,
        "load_seconds": load_seconds,
        "kmeans_seconds": kmeans_seconds,
        "fit_seconds": fit_seconds,
        "total_seconds": total_seconds,
        "train_seconds": train_seconds,
        "seconds_per_epoch": train_seconds / args.epochs,
        "evaluation_seconds": fit_seconds - train_seconds,
        "evaluation_parts_seconds": phases,
        "train_pairs_per_s": len(train.X) * args.n_components * args.epochs / train_seconds,
        "final_train_loglik": model.history_[-1]["train_loglik"],
        "final_val_loglik": model.history_[-1]["val_loglik"],
    }
    print(json.dumps(row), flush=True)
    info = {"benchmark": "bench_paper_fit", **machine(), "device": device_name(device)}
    write_result(
        f"bench_paper_fit_{device.type}" + (f"_{args.label}" if args.label else ""), {**info, "results": [row]}
    )


if __name__ == "__main__":
    main()

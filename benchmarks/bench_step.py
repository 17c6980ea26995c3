"""What one minibatch step costs beyond its statistics pass; writes JSON to benchmarks/results/.

    python benchmarks/bench_step.py                                   # CPU, K = 64, batch 500
    python benchmarks/bench_step.py --device cuda --n-components 64 512

For minibatch EM and SGD, three times per step, each the best of ``--rounds`` rounds that run all three
one after another (one device synchronisation per run of ``--steps`` steps, so a GPU's queue stays full as
in a fit):

* ``pass_s``: the statistics pass alone, as the loop takes it, on a batch already on the device: on the CPU
  with the fused kernel ``fused.PlainPass`` (``pass`` "plain"; its sums as arrays where the fitter has a
  compiled rule, ``engines.cpu``), elsewhere ``batch_statistics`` ("general");
* ``step_s``: the pass and the fitter's float64 update (``fitter.observe``, or its compiled rule's
  ``observe_sums``);
* ``loop_step_s``: a whole fit's training seconds per batch in its second epoch (``XDGMM.fit``, evaluation
  excluded; the first epoch compiles, or captures graphs): batch gathering, the pass, the update and the
  loop's Python; on CUDA also ``graphed_loop_step_s``, the same with each step replayed as one CUDA graph
  (``fit/engines/cuda.py``, the fit's default there).

``overhead_s`` and ``loop_overhead_s`` (``graphed_loop_overhead_s``): the median over rounds of the step's
(the fit's) time less the pass's in the same round, the time a faster kernel cannot remove. ``updates`` says
which updates ran: "fused" (the compiled CPU rules, ``fit/rules/*_numba.py``, the CPU's default),
"triton" (on CUDA, online EM's update as one Triton kernel and SGD's as two in the graphed step,
``fit/rules/*_triton.py``: they change only ``graphed_loop_step_s``) or "torch" (``fit/rules/online_em.py``,
``fit/rules/sgd.py``); each device measures its own and "torch", in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from statistics import median

import torch

from scalable_xd import XDGMM
from scalable_xd._torch import resolve_device, synchronize
from scalable_xd.data.batching import Batch
from scalable_xd.data.dataset import Dataset
from scalable_xd.fit.driver import regularisation
from scalable_xd.fit.methods import for_data, make_fitter
from scalable_xd.fit.rules import forms
from scalable_xd.kernel import TABLE
from scalable_xd.kernel.dispatch import batch_statistics, choose_backend
from scalable_xd.kernel.fused import PlainPass
from scalable_xd.settings import FitSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_name, forced_kernel, machine, parse_args, write_result  # noqa: E402
from bench_fit import synthetic  # noqa: E402

METHODS = ("minibatch_em", "sgd")


def paired_per_step(runs, steps: int, rounds: int) -> list[list[float]]:
    """Seconds per step of each of ``runs`` (each takes a step count and gives its seconds per step), in
    ``rounds`` rounds that run them one after another, after a warm-up run of each: a drift of the
    machine's speed falls on all of them alike, so that a round's differences hold where the best of each,
    taken apart, may not."""
    for run in runs:
        run(steps)
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for run, spent in zip(runs, times):
            spent.append(run(steps))
    return times


def by_the_clock(run, device):
    """``run`` (of ``steps`` back-to-back steps) as a function giving its seconds per step, with one device
    synchronisation, so that a GPU's queue stays full as in a fit."""

    def timed(steps: int) -> float:
        tick = time.perf_counter()
        run(steps)
        synchronize(device)
        return (time.perf_counter() - tick) / steps

    return timed


def measure(
    method: str, k: int, batch: int, dtype, device, backend: str, steps: int, rounds: int, updates: str
) -> dict:
    x, S, mixture = synthetic(batch * steps, k, dtype)
    x, S = x.to(device), S.to(device)
    start = mixture.to(device, torch.float64)
    settings = for_data(FitSettings(method=method), len(x))
    w = regularisation(settings, Dataset(x.cpu(), S.cpu(), validate=False), start)
    fitter = make_fitter(settings, start, data_size=len(x), w=w)
    fitter.start_epoch(0)
    rows = [slice(i * batch, (i + 1) * batch) for i in range(steps)]
    plain = None
    if device.type == "cpu" and choose_backend(backend, None, device) == "fused":
        plain = PlainPass(x.shape[1], k, dtype, TABLE["fused"].max_pairs["cpu"])

    def statistics(i: int):
        """The batch's sums as the loop takes them: arrays for a fitter that takes them, else Statistics."""
        if plain is not None and fitter.compiled is not None:
            sums = plain.sums(Batch(batch, x[rows[i]], S[rows[i]], None, None), *fitter.compiled.arrays())
            if sums is not None:
                return sums
        stats = (
            None
            if plain is None
            else plain.statistics(Batch(batch, x[rows[i]], S[rows[i]], None, None), fitter.mixture)
        )
        return batch_statistics(x[rows[i]], S[rows[i]], fitter.mixture, backend=backend) if stats is None else stats

    def passes(n):
        for i in range(n):
            statistics(i)

    def passes_and_updates(n):
        for i in range(n):
            sums = statistics(i)
            if isinstance(sums, tuple):
                fitter.compiled.observe_sums(*sums)
            else:
                fitter.observe(sums)

    def loop_step(cuda_graphs: bool) -> float:
        """A fit's training seconds per step in its second epoch (the first compiles, or captures graphs)."""
        with forced_kernel(backend):
            model = XDGMM(
                k,
                method,
                batch_size=batch,
                epochs=2,
                tol=None,
                device=str(device),
                dtype=str(dtype).removeprefix("torch."),
                cuda_graphs=cuda_graphs,
                random_state=0,
                weights_init=start.weights.cpu().numpy(),
                means_init=start.means.cpu().numpy(),
                covariances_init=start.covariances.cpu().numpy(),
            ).fit(x.cpu(), Xcov=S.cpu())
        return (model.history_[2]["seconds"] - model.history_[1]["seconds"]) / steps

    runs = [by_the_clock(passes, device), by_the_clock(passes_and_updates, device), lambda n: loop_step(False)]
    if device.type == "cuda":  # each step replayed as one CUDA graph (``fit/engines/cuda.py``)
        runs.append(lambda n: loop_step(True))
    pass_times, step_times, loop_times, *graphed_times = paired_per_step(runs, steps, rounds)

    def beyond_the_pass(times: list[float]) -> float:
        return median(t - one_pass for one_pass, t in zip(pass_times, times))

    graphed = {}
    if graphed_times:
        graphed = {
            "graphed_loop_step_s": min(graphed_times[0]),
            "graphed_loop_overhead_s": beyond_the_pass(graphed_times[0]),
        }
    return {
        "method": method,
        "K": k,
        "D": x.shape[1],
        "batch": batch,
        "dtype": str(dtype).removeprefix("torch."),
        "backend": backend,
        "updates": updates,
        "pass": "general" if plain is None else "plain",
        "pass_s": min(pass_times),
        "step_s": min(step_times),
        "overhead_s": beyond_the_pass(step_times),
        "loop_step_s": min(loop_times),
        "loop_overhead_s": beyond_the_pass(loop_times),
        **graphed,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n-components", type=int, nargs="+", default=[64])
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--steps", type=int, default=100, help="steps per timed run (and batches per epoch)")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs; the best is reported")
    parser.add_argument("--label", default=None, help="suffix of the output file name")
    args = parse_args(parser, argv, n_components=[4], steps=5, rounds=1)
    device, dtype = resolve_device(args.device), getattr(torch, args.dtype)
    rows = []
    compiled = {"fused": forms.compiled, "triton": forms.triton_form}
    available = {"fused": device.type == "cpu" and importlib.util.find_spec("numba") is not None}
    available["triton"] = forms.triton_form("online_em", device) is not None
    for updates in [name for name in compiled if available[name]] + ["torch"]:
        if updates == "torch":
            forms.compiled, forms.triton_form = (lambda fitter, device: None), (lambda rule, device: None)
        for k in args.n_components:
            for method in METHODS:
                row = measure(method, k, args.batch_size, dtype, device, args.backend, args.steps, args.rounds, updates)
                print(json.dumps(row), flush=True)
                rows.append(row)
    forms.compiled, forms.triton_form = compiled["fused"], compiled["triton"]
    info = {"benchmark": "bench_step", **machine(), "device": device_name(device)}
    write_result(f"bench_step_{device.type}" + (f"_{args.label}" if args.label else ""), {**info, "results": rows})


if __name__ == "__main__":
    main()

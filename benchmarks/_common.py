"""Shared bits of the benchmarks: machine description and JSON output."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# Where ``write_result`` writes: results/, or with ``--quick`` the folder $BENCH_QUICK_RESULTS or a new
# temporary one, so that a quick run never replaces a measured JSON.
destination = Path(os.environ.get("BENCH_RESULTS") or RESULTS)  # elsewhere for a session's side runs


def machine() -> dict:
    import numpy as np
    import torch

    import scalable_xd

    return {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "scalable_xd": scalable_xd.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "numba": _version("numba"),
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def first_and_best(call, repeats: int) -> tuple[float, float]:
    """(seconds of ``call``'s first run: a compile, a cache load, a warm-up; the best of ``repeats`` more)."""
    import time

    tick = time.perf_counter()
    call()
    first = time.perf_counter() - tick
    best = float("inf")
    for _ in range(repeats):
        tick = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - tick)
    return first, best


def device_name(device) -> str:
    """The GPU's model name, or "cpu"."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def parse_args(parser, argv, **quick):
    """``parser``'s options plus ``--quick``: the options in ``quick`` set to tiny values (seconds on two
    cores) and the JSON kept out of results/. The test suite runs every benchmark so, so none rots."""
    global destination

    parser.add_argument(
        "--quick",
        action="store_true",
        help="a check that the benchmark runs: tiny sizes, the JSON in $BENCH_QUICK_RESULTS or a temporary folder",
    )
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in quick.items():
            setattr(args, name, value)
        destination = Path(os.environ.get("BENCH_QUICK_RESULTS") or tempfile.mkdtemp(prefix="bench-quick-"))
    return args


def write_result(name: str, result: dict) -> Path:
    """Write ``result`` to ``<destination>/<name>.json`` atomically (a stopped run leaves the last whole file)."""
    destination.mkdir(parents=True, exist_ok=True)
    path = destination / f"{name}.json"
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(result, indent=2) + "\n")
    partial.replace(path)
    print(f"wrote {path}")
    return path


# Python run at the top of a benchmark's child process: ``status()`` reads RssAnon and VmHWM (bytes) from
# /proc, and a thread keeps the peak RssAnon in ``peak`` (sampled every 10 ms) until ``done`` is set.
MEMORY_SAMPLER = r"""
import threading, time

def status():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields

peak = {"RssAnon": 0}
done = False
def sample():
    while not done:
        peak["RssAnon"] = max(peak["RssAnon"], status()["RssAnon"])
        time.sleep(0.01)
threading.Thread(target=sample, daemon=True).start()
"""


@contextmanager
def forced_kernel(backend: str):
    """Fits inside run the statistics pass (and the fitted model scores) on ``backend`` ("fused",
    "unrolled", "compiled"), whatever the fit would choose (``kernel.dispatch.fit_backend``)."""
    import scalable_xd.fit.driver
    import scalable_xd.fitted_model

    modules = (scalable_xd.fit.driver, scalable_xd.fitted_model)
    chosen = [module.fit_backend for module in modules]
    for module in modules:
        module.fit_backend = lambda name, device: backend
    try:
        yield
    finally:
        for module, original in zip(modules, chosen):
            module.fit_backend = original

"""scalable-xd: extreme deconvolution Gaussian mixtures fitted by batch EM, minibatch EM and SGD.

from scalable_xd import XDGMM
model = XDGMM(n_components=64, method="minibatch_em").fit(X, Xcov=Xcov)
"""

import os
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

# GNU OpenMP (torch's and numba's thread pools) spins a thread waiting at a parallel region's end 300,000
# times before it sleeps. On a machine shared with other work the spinning thread takes the core from the
# thread being waited for; 3,000 spins lose far less beside other work, and still outlast the serial part
# of a minibatch step, so the kernel's threads are awake for its next pass: 1,000 let them fall asleep at
# every step, and waking them cost more than the spinning saved (docs/performance.md,
# ``benchmarks/bench_contention.py``). It is read when OpenMP loads, so it is set before torch or numba is
# imported, and only where unset.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from .errors import FitDivergedError, NotPositiveDefiniteError

# Imported on first use, so that `scalable-xd --help` and the light modules do not load torch.
_LAZY = {
    "XDGMM": "estimator",
    "CompactCovariance": "data.noise",
    "NoiseMixture": "data.noise_mixture",
    "fit_together": "together",
    "steps_together": "together",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


try:
    __version__ = version("scalable-xd")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "XDGMM",
    "CompactCovariance",
    "NoiseMixture",
    "FitDivergedError",
    "NotPositiveDefiniteError",
    "fit_together",
    "steps_together",
    "__version__",
]

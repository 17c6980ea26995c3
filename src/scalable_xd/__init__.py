"""scalable-xd: extreme deconvolution Gaussian mixtures fitted by batch EM, minibatch EM and SGD.

from scalable_xd import XDGMM
model = XDGMM(n_components=64, method="minibatch_em").fit(X, Xcov)
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

from .errors import FitDivergedError, NotPositiveDefiniteError

# Imported on first use, so that `scalable-xd --help` and the light modules do not load torch.
_LAZY = {"XDGMM": "estimator", "CompactCovariance": "noise"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


try:
    __version__ = version("scalable-xd")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["XDGMM", "CompactCovariance", "FitDivergedError", "NotPositiveDefiniteError", "__version__"]

"""scalable-xd: extreme deconvolution Gaussian mixtures fitted by batch EM, minibatch EM and SGD.

    from scalable_xd import XDGMM
    model = XDGMM(n_components=64, method="minibatch_em").fit(X, Xcov)
"""

from importlib.metadata import PackageNotFoundError, version

from .errors import FitDivergedError, NotPositiveDefiniteError
from .estimator import XDGMM
from .noise import CompactCovariance

try:
    __version__ = version("scalable-xd")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["XDGMM", "CompactCovariance", "FitDivergedError", "NotPositiveDefiniteError", "__version__"]

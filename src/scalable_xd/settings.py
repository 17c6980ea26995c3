"""The fit settings: every default, constraint and one-line description, written once.

``XDGMM``'s constructor takes its defaults from ``FitSettings`` and validates through it; ``scalable-xd
fit`` builds its options from the fields (help, default, choices); the workflow's config schema states the
same defaults, which a test checks. ``KMeansSettings`` does the same for the k-means initialisation.

A leaf: it imports nothing of the package. The vocabularies others own are checked by their owners: the
method and what it allows by the method table (``fit.methods.check_settings``, which also resolves the
epoch budget), the backend by the kernel (``kernel.BACKENDS``); ``fit.methods.SETTING_CHOICES`` hands both
to those who show the choices, and ``fit.methods.setting_help`` the methods' own budgets to those who show
the help (the command line, the estimator's docstring, the config's README).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import MISSING, asdict, dataclass, field, fields

import numpy as np

SCHEDULES = ("step", "cappe_moulines", "power")
AVERAGING = ("none", "polyak")
MISSING_MODES = ("variance", "marginalise")  # the convention's numbers: ``data.missing``
COVARIANCE_UPDATES = ("stable", "naive")
SGD_SCALINGS = ("component", "spread", "none")
W_SCALES = ("variance", "none")
ACCELERATIONS = ("squarem", "none")
ONLINE_REGULARISATIONS = ("prior", "paper")
DTYPES = ("float32", "float64")
SELECTION_MODES = ("observed", "true")


def setting(default, help: str, *, choices=None, low=None, high=None, low_open=False, nullable=False):
    """A dataclass field with its constraint: one of ``choices``, or a number in [low, high] (``low_open``:
    (low, high]); ``nullable``: None is allowed too."""
    return field(
        default=default,
        metadata=dict(help=help, choices=choices, low=low, high=high, low_open=low_open, nullable=nullable),
    )


def _check(name: str, value, meta: dict, kind: type) -> None:
    if value is None and meta["nullable"]:
        return
    if meta["choices"] is not None:
        if value not in meta["choices"]:
            raise ValueError(f"unknown {name} {value!r}: choose one of {', '.join(map(str, meta['choices']))}")
        return
    if kind is str:  # free-form strings (the device) are checked where they are used
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return
    if kind is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name} must be True or False, got {value!r}")
        return
    if kind is int:
        check_count(name, value, meta["low"], meta["high"])
        return
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > meta["low"] if meta["low_open"] else value >= meta["low"])
    ok = ok and (meta["high"] is None or value <= meta["high"])
    if not ok:
        bracket = "(" if meta["low_open"] else "["
        high = "inf)" if meta["high"] is None else f"{meta['high']}]"
        raise ValueError(f"{name} must be in {bracket}{meta['low']}, {high}, got {value!r}")


class _Settings:
    """Validation and conversion shared by the settings dataclasses."""

    def __post_init__(self):
        for f in fields(self):
            _check(f.name, getattr(self, f.name), f.metadata, _kind(f))

    def as_dict(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]  # every subclass is a dataclass

    @classmethod
    def defaults(cls) -> dict:
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}  # type: ignore[arg-type]


def _kind(f) -> type:
    """The field's base type from its annotation ("int", "float | None", ...)."""
    name = str(f.type).split("|")[0].strip()
    return {"int": int, "float": float, "bool": bool, "str": str}[name]


@dataclass(frozen=True)
class FitSettings(_Settings):
    """How a mixture is fitted (everything but K, the seed and explicit initial parameters)."""

    method: str = setting(
        "em",
        "em (Bovy et al. 2011 batch EM), minibatch_em (online EM), sgd (Adam), or "
        "stochastic EM: stochastic_em (batch) or stochastic_minibatch_em",
    )
    epochs: int | None = setting(
        None,
        "passes over the training data (for em: iterations at most); None: the method's own budget, in which "
        "its defaults reached 90% of what converged XD achieves on the documented data shapes "
        "(docs/user-guide/converged.md)",
        low=1,
        nullable=True,
    )
    batch_size: int | None = setting(
        None,
        "points per minibatch for minibatch_em and sgd (em sums over all points); None: 500, the paper's, or "
        "N // 20 (at least 8) on fewer than 10,000 points, so that an epoch makes 20 updates",
        low=1,
        nullable=True,
    )
    step_size: float = setting(0.1, "minibatch EM's (first) step size (the paper: 0.01)", low=0, high=1, low_open=True)
    step_schedule: str = setting(
        "step",
        "minibatch EM steps: step_size times step_decay after decay_epoch (the paper's form), "
        "(t0 + t)^-kappa from step_size (Cappe & Moulines), or step_size r^-kappa for update r (power)",
        choices=SCHEDULES,
    )
    step_decay: float = setting(
        0.5, "factor on the step size after decay_epoch (schedule 'step')", low=0, high=1, low_open=True
    )
    kappa: float = setting(
        0.51,
        "exponent of the cappe_moulines and power schedules: near 0.5, the slowest decay Cappe & Moulines "
        "allow; Nguyen, Forbes & McLachlan's power schedule used 0.6",
        low=0.5,
        high=1,
        low_open=True,
    )
    lr: float = setting(1e-2, "SGD (Adam) learning rate", low=0, low_open=True)
    lr_decay: float = setting(0.1, "factor on the learning rate after decay_epoch", low=0, high=1, low_open=True)
    decay_epoch: int | None = setting(
        None,
        "epochs before the step size or learning rate decays; None: half the epochs (the paper's 10 of 20)",
        low=0,
        nullable=True,
    )
    sgd_scaling: str = setting(
        "component",
        "SGD parameters in units of each component's starting spread in each feature (one learning rate then "
        "suits features of any scale and components of any width), of each feature's spread in the data "
        "(spread), or in the features' own units (none, the paper)",
        choices=SGD_SCALINGS,
    )
    w: float = setting(
        1e-6,
        "covariance regularisation W = w diag(s), s as w_scale says (em: Bovy et al.'s V = (sum + W) / (q + 1); "
        "minibatch_em: the same prior, or W added after each update; sgd: the penalty 1 / tr(W^-1 V)); 0: none",
        low=0,
    )
    w_scale: str = setting(
        "variance",
        "what w is relative to: variance, each feature's variance in the data, so that one w suits features "
        "of any units; none, the features' own squared units (Bovy et al.'s w I, the paper's 1e-3)",
        choices=W_SCALES,
    )
    online_regularisation: str = setting(
        "prior",
        "minibatch EM's use of w: prior, the prior batch EM's (sum + wI)/(q + 1) implies, scaled to the data "
        "(V = (c Vr + wI)/(c + 1), c a component's share of the stars), so both have one fixed point; or "
        "paper, w I added to every covariance, as the paper's code does (each variance then ends w too large)",
        choices=ONLINE_REGULARISATIONS,
    )
    tol: float | None = setting(
        1e-6,
        "em stops once an iteration improves the mean training log-likelihood by less (None: run every epoch)",
        low=0,
        nullable=True,
    )
    train_score_rows: int | None = setting(
        100_000,
        "minibatch methods score the training data after every epoch (the history's train_loglik) on a fixed "
        "random sample of this many points chosen by the seed, so that an epoch is not taxed with a second "
        "full pass and the figures compare across epochs; None: every point, as the paper measured (em's pass "
        "scores every point at no cost)",
        low=1,
        nullable=True,
    )
    acceleration: str = setting(
        "squarem",
        "batch EM (em without split_merge): squarem extrapolates along EM's steps (Varadhan & Roland 2008), "
        "reaching EM's own fixed point in fewer passes; none is plain EM (Bovy et al., the paper)",
        choices=ACCELERATIONS,
    )
    averaging: str = setting(
        "none",
        "polyak: report the running mean of the parameters over all updates "
        "(minibatch methods; the updates themselves unchanged)",
        choices=AVERAGING,
    )
    truncation: bool = setting(
        False,
        "minibatch EM restarts from the initial parameters whenever they leave "
        "the growing compact sets of Nguyen, Forbes & McLachlan",
    )
    reseed_dead: bool = setting(
        True,
        "minibatch EM re-seeds, at each epoch's end, each component whose "
        "weight fell below one star's worth (1/N) from the heaviest, split along its principal axis (as "
        "split-and-merge splits), so that it keeps the capacity asked for (docs/user-guide/fitting.md); "
        "False leaves them dead, as the paper's code did; a fit that ends with dead components warns either way",
    )
    truncation_bound: float = setting(
        1000.0, "c1 = c2 = c3 of the truncation sets, in the features' units", low=1, low_open=True
    )
    split_merge: bool = setting(
        False,
        "split-and-merge moves (Ueda et al.): em after convergence, each kept only "
        "if the converged log-likelihood improves; minibatch methods one per epoch, "
        "judged on a fixed validation sample",
    )
    split_merge_tries: int = setting(5, "split-and-merge moves tried at most", low=1)
    n_init: int | None = setting(
        None,
        "starts fitted, the best kept (scikit-learn's n_init): start s is the fit of seed random_state + s, "
        "judged by its final validation log-likelihood where validation data are given, else its training "
        "one; XD's likelihood has many local optima, and restarts are the defence; None: 3 where the fit is "
        "small (N x K at most 1e6) and its start not given (means_init, warm_start), else 1, said on the "
        "scalable_xd.fit logger",
        low=1,
        nullable=True,
    )
    covariance_update: str = setting(
        "stable", "minibatch EM's covariance update: the centred form or the paper's eq. 7", choices=COVARIANCE_UPDATES
    )
    missing: str = setting(
        "variance",
        "missing entries: the paper's convention, value 0 with variance 1e12 scored as "
        "measured (variance), or marginalised exactly, NaN or variance >= 1e12 marking them "
        "(marginalise)",
        choices=MISSING_MODES,
    )
    selection: str | None = setting(
        None,
        "a known selection the training data went through, as limits on features by name joined by commas "
        "('phot_g_mean_mag < 19.5, parallax > 0'; an estimator's array columns are x0, x1, ...): the fit "
        "models the population before it, each batch carrying the points it removed, drawn from the model "
        "(Monte Carlo EM; docs/user-guide/selection.md); the workflow first applies it to its training and "
        "validation splits, read in memory whatever fit.stream_window, which leaves a catalogue the survey "
        "already cut so as it is; None: the data are the population",
        nullable=True,
    )
    selection_on: str = setting(
        "observed",
        "what the selection saw: the measured values (observed) or the noise-free ones (true)",
        choices=SELECTION_MODES,
    )
    selection_aware: bool = setting(
        True,
        "False: the fit ignores the selection and models the kept points as they are (the naive fit, which "
        "the workflow runs beside the aware one for comparison)",
    )
    background: str | None = setting(
        None,
        "a uniform background component for outliers, over a box of the measured features: 'auto' (the "
        "training data's bounding box) or one 'lower:upper' range per feature joined by commas; its weight "
        "is fitted beside the mixture's (as in pygmmis; docs/user-guide/background.md); None: no background",
        nullable=True,
    )
    background_weight: float = setting(
        0.1, "the background's starting weight (its share of the points)", low=0, high=0.99, low_open=True
    )
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda or cuda:N")
    dtype: str = setting("float32", "precision of the statistics pass (parameters are always float64)", choices=DTYPES)
    backend: str = setting(
        "auto",
        "the statistics pass: auto (fused on the CPU; triton on CUDA where installed, else compiled), fused (numba, "
        "CPU), triton (CUDA), compiled (torch.compile), unrolled (eager torch) or linalg (batched LAPACK)",
    )
    cuda_graphs: bool = setting(
        True, "on CUDA, replay each minibatch step as one CUDA graph (False: its ~100 kernels launched one by one)"
    )
    verbose: int = setting(
        0, "0 silent, 1 a line per epoch (logger scalable_xd.fit), 2 also a progress bar per epoch", low=0, high=2
    )


@dataclass(frozen=True)
class KMeansSettings(_Settings):
    """The minibatch k-means that gives the initial weights and means."""

    epochs: int = setting(10, "passes of minibatch k-means", low=1)
    batch_size: int = setting(500, "points per k-means minibatch", low=1)


def numpydoc_parameters(
    cls, prefix: str = "", indent: str = "    ", choices: dict | None = None, help_of=lambda name, text: text
) -> str:
    """numpydoc "Parameters" entries for the fields of a settings dataclass (``XDGMM``'s docstring): the
    type or choices and the default from the field, the description from its help, so none can drift;
    ``choices`` gives those of the fields whose vocabulary another module owns, ``help_of(name, help)``
    what it adds to their help (see the module)."""
    entries = []
    for f in fields(cls):
        meta = f.metadata
        options = (choices or {}).get(f.name, meta["choices"])
        if options is not None:
            kind = "{" + ", ".join(repr(c) for c in options) + "}"
        else:
            kind = str(f.type).replace(" | None", " or None")
        body = textwrap.fill(
            help_of(f.name, meta["help"]) + ".",
            100,
            initial_indent=indent * 2,
            subsequent_indent=indent * 2,
            break_on_hyphens=False,
        )
        entries.append(f"{indent}{prefix}{f.name} : {kind}, default={f.default!r}\n{body}")
    return "\n".join(entries)


def check_count(name: str, value, minimum: int = 1, maximum: int | None = None) -> None:
    """Counts (K, epochs, samples, ...) are integers, not bools, in [minimum, maximum]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        what = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value!r}")


def check_seed(name: str, value) -> None:
    """Integer seeds must lie in [0, 2**63): what torch's and numpy's generators both accept."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2**63:
        raise ValueError(
            f"{name} must be None, an integer in [0, 2**63), a numpy RandomState or Generator, got {value!r}"
        )


def resolve_seed(random_state, name: str = "random_state") -> int:
    """An integer seed from None (fresh entropy), an int, a numpy ``RandomState`` or ``Generator`` (one draw,
    advancing it, as scikit-learn does)."""
    if random_state is None:
        entropy = np.random.SeedSequence().entropy
        assert isinstance(entropy, int)  # drawn fresh, not given: one int
        return entropy % 2**62
    if isinstance(random_state, np.random.RandomState):
        return int(random_state.randint(0, 2**62, dtype=np.int64))
    if isinstance(random_state, np.random.Generator):
        return int(random_state.integers(0, 2**62))
    check_seed(name, random_state)
    return int(random_state)

"""XD under a known selection function: every batch carries its share of the points the selection removed.

A catalogue holds only the points a selection kept, each with probability ``P(kept | value)`` known to the
user (a magnitude limit, a cut on a measured quantity). Fitted to the kept points alone, XD models the
selected population. Here, as in Melchior & Goulding (2018, pygmmis), each batch's statistics gain those of
points drawn from the current model that the selection *removed*, so that EM sees a complete sample and its
fixed point is the maximum of the selected data's likelihood (a Monte Carlo EM: Wei & Tanner 1990).

The draws for a batch of B kept points: candidates from the current mixture, each with a noise covariance
(by default that of a random point of the same batch, i.e. noise independent of the selection), observed
with that noise, and kept or removed by the selection on the observed value (``on="observed"``) or on the
true one (``on="true"``); drawing stops at the B-th kept candidate, and the removed ones drawn so far are
the batch's imputed points. Their number is then what the model itself predicts for B kept points
(B (1 - f) / f on average, f the model's kept fraction), without f being estimated anywhere.

The candidates are drawn on the CPU from a generator that depends only on (seed, epoch, batch, rank), so a
resumed fit draws what the uninterrupted one drew, and data-parallel processes, each imputing for its share
of a batch, sum to one set of statistics.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..data.batching import Batch, generator
from ..data.noise_mixture import NoiseMixture
from ..mixture import Mixture

SELECTED_ON = ("observed", "true")
_OPERATORS = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal}
IMPUTATION_STREAM = 2  # the generator key that sets these draws apart from the S-step's uniforms (1)
# What a fit under a selection cannot take (the drawn points have none of it): attribute, as users name it.
UNSUPPORTED = (("R", "projections R"), ("weights", "sample_weight or point weights"), ("observed", "missing entries"))


@dataclass(frozen=True)
class Selection:
    """A known selection function. ``probability``: a vectorised callable from values (n, d), a float64 numpy
    array in the data's features, to the probability (n,) in [0, 1] that a point of those values is in the
    catalogue. ``on``: whether the selection saw the measured values ("observed": magnitude limits, cuts on
    measured quantities) or the noise-free ones ("true"). ``noise``: the noise covariances of the points
    that were never observed: "resample", those of random points of the same batch (noise independent of
    the selection); or a callable from true values (n, d) to covariances (n, d, d). ``max_draws``: the
    candidates drawn per kept point at most, before the fit is refused (a model that puts almost none of its
    mass where the selection keeps points). ``spec``: the limits it was read from (``from_limits``), if any."""

    probability: Callable[[np.ndarray], np.ndarray]
    on: str = "observed"
    noise: str | Callable[[np.ndarray], np.ndarray] = "resample"
    max_draws: int = 1000
    spec: str | None = None

    def __post_init__(self):
        if not callable(self.probability):
            raise ValueError(f"selection: probability must be a callable of values (n, d), got {self.probability!r}")
        if self.on not in SELECTED_ON:
            raise ValueError(f"selection: on must be one of {', '.join(SELECTED_ON)}, got {self.on!r}")
        if self.noise != "resample" and not callable(self.noise):
            raise ValueError(f"selection: noise must be 'resample' or a callable of true values, got {self.noise!r}")
        if isinstance(self.max_draws, bool) or not isinstance(self.max_draws, int) or self.max_draws < 2:
            raise ValueError(f"selection: max_draws must be an integer >= 2, got {self.max_draws!r}")

    def kept(self, values: np.ndarray) -> np.ndarray:
        """The probability (n,) that points of these values are kept, checked: one number a point, in [0, 1]."""
        p = _numbers(self.probability(values), f"the probability function {_name(self.probability)}")
        if p.shape != (len(values),):
            raise ValueError(
                f"selection: the probability function returned shape {p.shape} for {len(values)} points of "
                f"{values.shape[1]} features; it must return one probability a point, shape ({len(values)},)"
            )
        bad = np.flatnonzero(~((p >= 0) & (p <= 1)))  # NaN fails both
        if len(bad):
            raise ValueError(
                f"selection: the probability function returned {float(p[bad[0]])} for the values "
                f"{values[bad[0]].tolist()}; probabilities must lie in [0, 1]"
            )
        return p

    def noise_of(
        self, true: np.ndarray, batch: tuple[torch.Tensor, torch.Tensor] | None, draw: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Noise covariances (n, d, d) for points of these true values and their square roots (``_roots``),
        float64 on the CPU; ``batch``: the batch's covariances and their roots, which "resample" draws from
        (None for a noise callable)."""
        if self.noise == "resample":
            assert batch is not None  # imputed_points factorises the batch's covariances for it
            rows = torch.randint(len(batch[0]), (len(true),), generator=draw)
            return batch[0][rows], batch[1][rows]
        assert callable(self.noise)
        S = _numbers(self.noise(true), f"the noise function {_name(self.noise)}")
        d = true.shape[1]
        if S.shape != (len(true), d, d) or not np.isfinite(S).all():
            raise ValueError(
                f"selection: the noise function returned shape {S.shape} (or values not finite) for {len(true)} "
                f"points of {d} features; it must return finite covariances of shape ({len(true)}, {d}, {d})"
            )
        return torch.from_numpy(S), _roots(torch.from_numpy(S))


def _name(function) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


def _numbers(returned, what: str) -> np.ndarray:
    """What a user's function returned as float64, or a ValueError naming the function and what it gave."""
    try:
        return np.asarray(returned, dtype=np.float64)
    except (TypeError, ValueError) as err:
        kind = getattr(np.asarray(returned), "dtype", type(returned))
        raise ValueError(f"selection: {what} returned values of type {kind}, not numbers ({err})") from None


def limits(spec: str, names: list[str]) -> list[tuple[int, str, float]]:
    """The clauses of limits on features by name, e.g. ``"phot_g_mean_mag < 19.5, parallax > 0"``, as
    (column, operator, limit); ``names``: the features' names in X's column order."""
    clauses = []
    for clause in spec.split(","):
        words = clause.split()
        if len(words) != 3 or words[1] not in _OPERATORS:
            raise ValueError(
                f"selection: {clause.strip()!r} is not a limit: write FEATURE OP NUMBER clauses, OP one of "
                f"{' '.join(_OPERATORS)}, joined by commas (e.g. 'phot_g_mean_mag < 19.5, parallax > 0')"
            )
        name, operator, number = words
        if name not in names:
            raise ValueError(f"selection: no feature {name!r} in {spec!r}; the features are {', '.join(names)}")
        try:
            limit = float(number)
        except ValueError:
            raise ValueError(f"selection: the limit {number!r} in {spec!r} is not a number") from None
        clauses.append((names.index(name), operator, limit))
    return clauses


def from_limits(spec: str, names: list[str], on: str = "observed") -> Selection:
    """A hard selection from ``limits``: a point is kept (probability 1) where every clause holds, else
    removed (0)."""
    tests = [(column, _OPERATORS[operator], limit) for column, operator, limit in limits(spec, names)]

    def kept(values: np.ndarray) -> np.ndarray:
        keep = np.ones(len(values), dtype=bool)
        for column, compare, limit in tests:
            keep &= compare(values[:, column], limit)
        return keep.astype(np.float64)

    return Selection(kept, on=on, spec=spec)


def check_kept_data(selection: Selection, x: torch.Tensor) -> None:
    """Refuse a selection on observed values that gives a point of the catalogue probability 0: the data
    contradict it (a cut on the wrong feature, or the wrong side of a limit)."""
    if selection.on != "observed" or len(x) == 0:
        return
    values = x.detach().to("cpu", torch.float64).numpy()
    p = selection.kept(values)
    zero = np.flatnonzero(p == 0)
    if len(zero):
        raise ValueError(
            f"selection: row {int(zero[0])} of X (values {values[zero[0]].tolist()}) is in the catalogue, but "
            f"the selection gives it probability 0 of being kept; check the selection's features and limits"
        )


def imputed_points(
    selection: Selection, mixture: Mixture, batch: Batch, keys: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The points the selection removed beside ``batch``'s kept ones, drawn from ``mixture`` (see the
    module): (x (M, d), S (M, d, d)) in the batch's dtype and device, M >= 0. ``keys``: (seed, epoch, batch,
    rank), which alone fix the draws."""
    refuse_unsupported(batch)
    wanted = len(batch.x)
    draw = generator(*keys, IMPUTATION_STREAM)
    batch_noise = None
    if selection.noise == "resample":
        batch_S = batch.S.detach().to("cpu", torch.float64)
        batch_noise = (batch_S, _roots(batch_S))
    xs, Ss = [], []
    kept = drawn = 0
    while kept < wanted:
        n = max(64, 2 * (wanted - kept))
        true, _ = mixture.sample(n, draw)
        S, roots = selection.noise_of(true.numpy(), batch_noise, draw)
        z = torch.randn(S.shape[:-1], generator=draw, dtype=S.dtype).unsqueeze(-1)
        observed = true + (roots @ z).squeeze(-1)  # a draw from N(0, S_i) for each
        judged = observed if selection.on == "observed" else true
        keep = torch.rand(n, generator=draw, dtype=torch.float64) < torch.from_numpy(selection.kept(judged.numpy()))
        last = torch.nonzero(keep.cumsum(0) == wanted - kept)  # candidates after the wanted-th kept are unused
        used = n if len(last) == 0 else int(last[0]) + 1
        removed = ~keep[:used]
        xs.append(observed[:used][removed])
        Ss.append(S[:used][removed])
        kept += int(keep[:used].sum())
        drawn += used
        if drawn > selection.max_draws * wanted:
            raise ValueError(
                f"selection: {drawn} points drawn from the model gave only {kept} the selection keeps, for a "
                f"batch of {wanted}: the model puts almost none of its mass where the selection keeps points "
                f"(raise max_draws, or check the selection against the data)"
            )
    like = batch.x
    return torch.cat(xs).to(like.device, like.dtype), torch.cat(Ss).to(like.device, like.dtype)


def _roots(S: torch.Tensor) -> torch.Tensor:
    """A square root L of each covariance (n, d, d), L L^T = S: its Cholesky factor, or, where S has none
    (a singular S: a noise-free feature), its symmetric square root, which draws zero along the null space."""
    factor, info = torch.linalg.cholesky_ex(S)
    singular = torch.nonzero(info).flatten()
    if len(singular):
        values, vectors = torch.linalg.eigh(S[singular])
        factor[singular] = vectors * values.clamp(min=0).sqrt().unsqueeze(-2)
    return factor


def refuse_unsupported(data) -> None:
    """Refuse data (a training source, or a batch of a streamed one) that hold what a selection cannot take."""
    for name, what in UNSUPPORTED:
        if getattr(data, name, None) is not None:
            raise ValueError(f"selection: not with {what} (the points drawn for what the selection removed have none)")


def check_selection(selection: Selection, train, settings) -> None:
    """Refuse, naming the setting, what a fit under a selection cannot take (``train``: the training
    ``DataSource``, ``settings``: its ``FitSettings``)."""
    if not isinstance(selection, Selection):
        raise ValueError(f"selection must be a fit.selection.Selection (or a callable of values), got {selection!r}")
    if settings.method == "em" and settings.tol is not None:  # left at its default, resolved (plan.for_options)
        raise ValueError(
            f"selection: tol={settings.tol}: a fit under a selection is Monte Carlo EM (the removed points are "
            "drawn afresh each pass), whose log-likelihood moves by about 1/sqrt(N) between passes, so tol "
            "cannot judge it: pass tol=None (or leave it at its default), and an epoch budget"
        )
    if settings.split_merge:
        raise ValueError("selection: not with split_merge (its trial fits see no removed points)")
    refuse_unsupported(train)
    if isinstance(getattr(train, "noise", None), NoiseMixture):
        raise ValueError(
            "selection: not with noise mixtures (the points drawn for what it removed have Gaussian noise)"
        )
    if isinstance(getattr(train, "X", None), torch.Tensor):
        check_kept_data(selection, train.X)


def record(selection: Selection | None, train) -> dict | None:
    """What a checkpoint keeps of the selection, to refuse resuming under another: its form, and a digest
    of its probabilities at the training data's first rows and at those rows stretched threefold about
    their mean, which reach where the catalogue has no points (a callable itself cannot be compared)."""
    if selection is None:
        return None
    first = train.sample(torch.arange(min(256, len(train))), "the selection's record").X.to(torch.float64)
    centre = first.mean(0)
    probes = torch.cat([first, centre + 3 * (first - centre)]).numpy()
    kept = selection.kept(probes)
    return {
        "on": selection.on,
        "noise": selection.noise if isinstance(selection.noise, str) else "callable",
        "kept_digest": hashlib.sha256(np.round(kept, 12).tobytes()).hexdigest()[:16],
    }

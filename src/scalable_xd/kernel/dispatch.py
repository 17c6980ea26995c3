"""The one statistics pass that every fitter, the scorer and the posterior stand on.

``batch_statistics`` returns the per-component sums described in ``statistics``; ``log_densities`` the
per-point log-likelihoods and per-pair log alpha_j N_ij. Both run over the batch in chunks of a bounded
number of (point, component) pairs, so memory stays bounded whatever the batch size, and pick a backend:

* ``"fused"`` (``fused``): one numba-compiled loop per (point, component) pair, vectorised across
  components; the CPU's fast path (~75 M pairs/s in float32 on two cores at D = 7, K = 64), compiled in a
  few seconds on first use and cached on disk. "auto" takes it on the CPU whenever R = I and numba is
  installed, and says once that it fell back to ``"unrolled"`` where numba is missing.
* ``"triton"`` (``triton_pass``): two hand-written Triton kernels over tiles of (component, star)
  pairs, the D x D algebra in registers; "auto" takes it on CUDA where triton is installed (on the CPU
  it runs only through Triton's interpreter, which the tests use).
* ``"compiled"``: the unrolled code through ``torch.compile``, which fuses its ~370 small ops per chunk
  into a few Triton kernels on CUDA (C++ loops on CPU, about half the fused kernel's speed), after a
  one-off compile of ~20-40 s per dtype (cached on disk by PyTorch); "auto" on CUDA without triton.
* ``"unrolled"`` (``unrolled``): entry-by-entry small-matrix algebra along the pair axis, as eager torch
  ops, on any device.
* ``"linalg"`` (``linalg``): batched LAPACK calls; the reference, and the path for projections R_i.

The mixture may be given in float64 (the fitters keep it so); the pass casts it to the data's dtype.

Missing entries marginalised exactly (``observed``, (B, d) bool): a star is scored and updated on its
observed dimensions only, R_i being the selection of those rows of the identity. The fused kernel does it
in its one pass, each star's missing rows and columns of T replaced by the identity's (``fused_source._masked_point``).
The other kernels group the stars by their pattern of observed dimensions, each group running the kernel at
its own smaller dimension on the mixture's marginal over those dimensions, its sums put back in the model's
dimensions (R_i^T u fills the observed entries of U, R_i^T T^-1 R_i the observed block of P): a pass per
pattern, which cost the fused kernel 8-95x its pass over complete data (2,000 stars, K = 7, D = 10 and 20,
a fifth of the entries missing). A star with nothing observed has p(x) = 1 and responsibilities alpha_j:
it counts towards the weights only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import warnings
from functools import cache

import torch

from ..data.noise_mixture import NoiseMixture
from ..errors import NotPositiveDefiniteError
from ..mixture import Mixture
from . import TABLE, check_backend, noise_mixture_pass
from .statistics import Statistics, assign, n_points

log = logging.getLogger(__name__)


def choose_backend(name: str, R, device: torch.device | None = None) -> str:
    """The one place a backend is chosen: projected batches (R given) always take the LAPACK path, since the
    other kernels handle R = I only; otherwise "auto" means the fused kernel on the CPU where numba is
    installed (the unrolled one, with a message, where not), and on CUDA the triton kernel where triton is
    installed, torch.compile's otherwise. A backend that cannot run on ``device`` is a clear error."""
    check_backend(name)
    if R is not None:
        return next(b.name for b in TABLE.values() if b.projections)
    kind = "cpu" if device is None else device.type if isinstance(device, torch.device) else torch.device(device).type
    if name != "auto" and kind not in TABLE[name].max_pairs:
        runs_on = " and ".join(k.upper() for k in TABLE[name].max_pairs)
        raise ValueError(f"the {name} kernel runs on the {runs_on} only; the data are on {device}")
    if name == "fused" and not _have_numba():
        raise ImportError("the fused kernel needs numba: pip install numba")
    if name == "triton":
        _check_triton(kind == "cpu")
    if name != "auto":
        return name
    if kind == "cpu":
        return "fused" if _numba_or_say_why() else "unrolled"
    if kind == "cuda":
        return "triton" if _have_triton() else "compiled"
    return "unrolled"


def fit_backend(name: str, device) -> str:
    """The backend a fit with setting ``backend=name`` runs on ``device`` (what its metrics record)."""
    return choose_backend(name, None, torch.device(device))


def _check_triton(on_cpu: bool) -> None:
    """The triton kernel runs on CUDA, and on the CPU only through Triton's interpreter."""
    if not _have_triton():
        raise ImportError("the triton kernel needs triton: pip install triton")
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "the triton kernel runs on CUDA devices; on the CPU only through Triton's interpreter "
            "(TRITON_INTERPRET=1 set before triton is imported), slowly: use backend 'fused' on the CPU"
        )


@cache
def _have_triton() -> bool:
    """Whether triton is installed (asked once: the fit asks for its backend every chunk)."""
    return importlib.util.find_spec("triton") is not None


@cache
def _have_numba() -> bool:
    """Whether numba is installed (asked once, as for triton)."""
    return importlib.util.find_spec("numba") is not None


@cache
def _numba_or_say_why() -> bool:
    """Whether numba is installed; if not, say so once, since the fallback is several times slower."""
    if not _have_numba():
        warnings.warn(
            "numba is not installed: the CPU statistics pass falls back to the torch kernel, 2-5x slower "
            "(pip install numba)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def chunks(n_points: int, n_components: int, max_pairs: int):
    """Slices of the batch holding at most ``max_pairs`` (point, component) pairs (at least one point)."""
    step = max(1, max_pairs // max(1, n_components))
    for start in range(0, n_points, step):
        yield slice(start, min(start + step, n_points))


def _chunk(backend: str, x, S, mixture: Mixture, R, with_stats: bool, start: int, extra: dict):
    """One chunk's (log p, log alpha N, Statistics or None) on ``backend`` (its ``statistics.Chunk``)."""
    return _chunk_function(backend)(x, S, mixture, R, with_stats, start, **extra)


@cache
def _chunk_function(backend: str):
    return TABLE[backend].chunk_function()


def _passes(
    x,
    S,
    mixture: Mixture,
    R,
    with_stats: bool,
    backend: str,
    max_pairs: int | None,
    point_weights=None,
    uniforms=None,
    with_criteria: bool = False,
    observed=None,
):
    """Yield (log p (B,), log alpha N (B, K) (None from the fused kernel's statistics pass without the
    criteria), Statistics or None) per chunk; ``observed`` for the fused kernel only (``_in_one_pass``).

    A float32 chunk in which some V_j + S_i cannot be factorised is computed again in float64 (from the
    mixture as given, before its cast) and returned in float32: a component whose covariance has a
    condition number beyond float32's ~1e7 can defeat the Cholesky factorisation in float32 alone. Only a
    pair that fails in float64 too is an error."""
    backend = choose_backend(backend, R, x.device)
    given, mixture = mixture, mixture.to(dtype=x.dtype)
    max_pairs = max_pairs or TABLE[backend].max_pairs["cuda" if x.is_cuda else "cpu"]
    for part in chunks(x.shape[0], mixture.n_components, max_pairs):
        extra = {
            "point_weights": None if point_weights is None else point_weights[part],
            "uniforms": None if uniforms is None else uniforms[part],
            "with_criteria": with_criteria,
            **({} if observed is None else {"observed": observed[part]}),
        }
        xs, Ss, Rs = x[part], S[part], None if R is None else R[part]
        try:
            out = _chunk(backend, xs, Ss, mixture, Rs, with_stats, part.start, extra)
        except NotPositiveDefiniteError as err:
            if x.dtype != torch.float32:
                raise
            _say_float64(err)
            wide = {key: value.double() if torch.is_tensor(value) else value for key, value in extra.items()}
            loglik, log_dens, stats = _chunk(
                backend,
                xs.double(),
                Ss.double(),
                given.to(dtype=torch.float64),
                None if Rs is None else Rs.double(),
                with_stats,
                part.start,
                wide,
            )
            out = (
                loglik.to(x.dtype),
                None if log_dens is None else log_dens.to(x.dtype),
                None if stats is None else stats.to(x.dtype),
            )
        yield out


def _say_float64(err: NotPositiveDefiniteError) -> None:
    log.debug(
        "float32 could not factorise V_j + S_i of chunk row %d, component %d: the chunk runs in float64",
        err.row,
        err.component,
    )
    _say_float64_once()


@cache
def _say_float64_once() -> None:
    log.warning(
        "float32 could not factorise some V_j + S_i: a covariance is too ill-conditioned for float32 "
        "(condition number beyond ~1e7), so the chunks holding such pairs are computed in float64"
    )


def patterns(observed: torch.Tensor):
    """Yield (rows, dims) for each pattern of observed dimensions in ``observed`` (B, d): the rows that share
    it and the dimensions it observes, as index tensors."""
    codes = (observed.long() << torch.arange(observed.shape[1], device=observed.device)).sum(1)
    for code in torch.unique(codes):
        rows = torch.nonzero(codes == code).squeeze(1)
        yield rows, torch.nonzero(observed[rows[0]]).squeeze(1)


def _marginal(x, S, mixture: Mixture, rows, dims):
    """The rows' observed entries and noise, and the mixture's marginal over those dimensions."""
    sub = Mixture(mixture.weights, mixture.means[:, dims], mixture.covariances[:, dims][:, :, dims])
    return x[rows][:, dims], S[rows][:, dims][:, :, dims], sub


def log_densities(
    x, S, mixture: Mixture, R=None, *, backend: str = "auto", max_pairs: int | None = None, observed=None
):
    """Per-point log-likelihood (B,) and log alpha_j N(x_i | R_i m_j, T_ij) (B, K) for one batch (of the
    ``observed`` entries only, where given); noise given as mixtures (``S`` a ``NoiseMixture``) through
    ``noise_mixture_pass``."""
    if isinstance(S, NoiseMixture):
        return noise_mixture_pass.log_densities(x, S, mixture, R, log_densities, backend=backend, max_pairs=max_pairs)
    if observed is not None and not _in_one_pass(backend, R, x):
        loglik = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
        log_dens = mixture.log_weights.to(x.dtype).expand(x.shape[0], -1).clone()  # nothing observed: alpha_j
        for rows, dims in patterns(observed):
            if len(dims):
                loglik[rows], log_dens[rows] = log_densities(
                    *_marginal(x, S, mixture, rows, dims), backend=backend, max_pairs=max_pairs
                )
        return loglik, log_dens
    parts = list(_passes(x, S, mixture, R, False, backend, max_pairs, observed=observed))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def batch_statistics(
    x,
    S,
    mixture: Mixture,
    R=None,
    *,
    backend: str = "auto",
    max_pairs: int | None = None,
    point_weights=None,
    uniforms=None,
    with_criteria: bool = False,
    observed=None,
) -> Statistics:
    """The per-component sums q, U, UU, P for one batch; ``point_weights`` (B,) weight each point's
    responsibilities, and ``uniforms`` (B,) replace them by sampled assignments (``statistics.assign``);
    ``with_criteria`` adds the split-and-merge sums (``statistics.Criteria``); ``observed`` (B, d)
    marginalises the other entries (see the module). Noise given as mixtures (``S`` a ``NoiseMixture``) runs
    through ``noise_mixture_pass``, which takes neither ``uniforms`` nor criteria."""
    if isinstance(S, NoiseMixture):
        if uniforms is not None or with_criteria or observed is not None:
            raise ValueError(
                "noise mixtures: not with stochastic EM, split_merge or missing entries (their draws and criteria "
                "are over components, not (component, noise component) pairs)"
            )
        options = dict(backend=backend, max_pairs=max_pairs)
        return noise_mixture_pass.batch_statistics(
            x, S, mixture, R, point_weights, log_densities, batch_statistics, **options
        )
    if observed is not None and not _in_one_pass(backend, R, x):
        return _marginalised_statistics(
            x, S, mixture, backend, max_pairs, point_weights, uniforms, with_criteria, observed
        )
    total: Statistics | None = None
    passes = _passes(x, S, mixture, R, True, backend, max_pairs, point_weights, uniforms, with_criteria, observed)
    for _, _, stats in passes:
        total = stats if total is None else total.combine(stats)
    if total is None:
        raise ValueError("batch_statistics needs at least one point")
    return total


def _in_one_pass(backend: str, R, x) -> bool:
    """Whether missing entries are marginalised inside the kernel, all the batch's patterns in one pass
    (the fused kernel: ``fused_source._masked_point``), rather than a pass per pattern of observed entries."""
    return R is None and choose_backend(backend, R, x.device) == "fused"


def _marginalised_statistics(
    x, S, mixture: Mixture, backend, max_pairs, point_weights, uniforms, with_criteria, observed
) -> Statistics:
    """``batch_statistics`` over groups of stars that share a pattern of observed dimensions, each group's
    sums put back in the model's dimensions."""
    k, dim = mixture.n_components, mixture.dim
    total = Statistics.zeros(k, dim, x.device, with_criteria)
    for rows, dims in patterns(observed):
        weights = None if point_weights is None else point_weights[rows]
        draws = None if uniforms is None else uniforms[rows]
        if len(dims) == 0:  # p(x) = 1 and r_ij = alpha_j: a share of the weights, nothing else
            resp = assign(mixture.weights.to(x.dtype).expand(len(rows), -1), weights, draws, dim=1)
            only_weights = dataclasses.replace(
                Statistics.zeros(k, dim, x.device, with_criteria),
                n_points=n_points(x[rows], weights),
                q=resp.sum(0).double(),
            )
            total = total.combine(only_weights)
            continue
        part = batch_statistics(
            *_marginal(x, S, mixture, rows, dims),
            backend=backend,
            max_pairs=max_pairs,
            point_weights=weights,
            uniforms=draws,
            with_criteria=with_criteria,
        ).double()
        U = torch.zeros(k, dim, dtype=torch.float64, device=x.device)
        UU = torch.zeros(k, dim, dim, dtype=torch.float64, device=x.device)
        P = torch.zeros_like(UU)
        U[:, dims] = part.U
        UU[:, dims[:, None], dims] = part.UU
        P[:, dims[:, None], dims] = part.P
        total = total.combine(Statistics(part.n_points, part.q, U, UU, P, part.loglik, part.criteria))
    return total

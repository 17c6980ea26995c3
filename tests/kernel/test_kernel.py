"""The statistics pass against scipy densities and the paper's eq. 4-5 written out pair by pair."""

import importlib.util
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import (
    float32_unfactorisable_problem,
    hard_kernel_problem,
    kernel_problem,
    max_row_relative_error,
    random_spd,
    xd_log_densities,
    xd_pair_posteriors,
)

from scalable_xd import XDGMM, kernel
from scalable_xd.data.batching import Batch, RowsInMemory
from scalable_xd.data.noise import CompactCovariance
from scalable_xd.errors import NotPositiveDefiniteError
from scalable_xd.kernel import dispatch, fused, fused_layout, fused_source
from scalable_xd.kernel.dispatch import batch_statistics, log_densities
from scalable_xd.kernel.linalg import linalg_chunk
from scalable_xd.mixture import Mixture

# The Triton kernel on CPU tensors: through Triton's interpreter (tests/conftest.py), on machines without a GPU.
TRITON = pytest.param(
    "triton",
    marks=pytest.mark.skipif(
        torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
        reason="triton on the CPU runs through its interpreter where there is no GPU (test_cuda.py covers GPUs)",
    ),
)


# The fused kernel in its looped form (``fused_layout.UNROLLED_MAX_DIM``) at every D: backend "fused" under the
# ``looped_fused`` fixture.
LOOPED = pytest.param("looped", id="fused_looped")


@pytest.fixture
def looped_fused(monkeypatch):
    monkeypatch.setattr(fused_layout, "UNROLLED_MAX_DIM", 0)
    fused.compiled_module.cache_clear()
    yield
    fused.compiled_module.cache_clear()


# The fused kernel's unrolled form cut into four loops over a tile's components (``fused_layout.SPLIT_MIN_DIM``, from
# D = 8 on) at every D: backend "fused" under the ``split_fused`` fixture.
SPLIT = pytest.param("split", id="fused_split")


@pytest.fixture
def split_fused(monkeypatch):
    monkeypatch.setattr(fused_layout, "SPLIT_MIN_DIM", 0)
    fused.compiled_module.cache_clear()
    fused_layout.layout.cache_clear()  # the split form's scratch has rows of its own
    yield
    fused.compiled_module.cache_clear()
    fused_layout.layout.cache_clear()


def _kernel(backend: str, request) -> str:
    """The backend to ask for; "looped" and "split" ask for the fused kernel in that form."""
    if backend not in ("looped", "split"):
        return backend
    request.getfixturevalue(f"{backend}_fused")
    return "fused"


def _mixture(weights, means, covs):
    return Mixture(*(torch.tensor(a) for a in (weights, means, covs)))


@pytest.mark.parametrize("backend", ["fused", "unrolled", "linalg"])
def test_log_densities_match_scipy(backend):
    rng = np.random.default_rng(1)
    x, S, weights, means, covs = kernel_problem(rng)
    loglik, log_dens = log_densities(torch.tensor(x), torch.tensor(S), _mixture(weights, means, covs), backend=backend)
    expected = xd_log_densities(x, S, weights, means, covs)
    np.testing.assert_allclose(log_dens.numpy(), expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(loglik.numpy(), np.logaddexp.reduce(expected, axis=1), rtol=1e-12)


@pytest.mark.parametrize(
    "projected, backend",
    [(False, "fused"), (False, "unrolled"), (False, "compiled"), (False, "linalg"), (True, "linalg")],
)
def test_statistics_reproduce_eq5_sums(projected, backend):
    """sum r b = q m + V U and sum r [(b - m)(b - m)^T + B] = q V + V (UU - P) V, per component."""
    rng = np.random.default_rng(2)
    d = 3
    x, S, weights, means, covs = kernel_problem(rng, d=d, d_obs=2 if projected else None)
    R = rng.normal(size=(x.shape[0], 2, d)) if projected else None
    stats = batch_statistics(
        torch.tensor(x),
        torch.tensor(S),
        _mixture(weights, means, covs),
        None if R is None else torch.tensor(R),
        backend=backend,
        max_pairs=37,  # force several chunks
    )
    r, b, B = xd_pair_posteriors(x, S, weights, means, covs, R)
    q = r.sum(0)
    np.testing.assert_allclose(stats.q.numpy(), q, rtol=1e-10)
    sum_rb = np.einsum("nk,nkd->kd", r, b)
    np.testing.assert_allclose(q[:, None] * means + np.einsum("kde,ke->kd", covs, stats.U.numpy()), sum_rb, rtol=1e-9)
    centred = b - means[None]
    scatter = np.einsum("nk,nkd,nke->kde", r, centred, centred) + np.einsum("nk,nkde->kde", r, B)
    from_stats = q[:, None, None] * covs + covs @ (stats.UU.numpy() - stats.P.numpy()) @ covs
    np.testing.assert_allclose(from_stats, scatter, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("backend", ["fused", LOOPED, TRITON, "unrolled", "compiled", "linalg"])
def test_failed_factorisation_names_row_and_component(backend, request):
    backend = _kernel(backend, request)
    rng = np.random.default_rng(3)
    x, S, weights, means, covs = kernel_problem(rng, n=10, k=3, d=2)
    S[:] = 0.0
    S[6:] = np.eye(2) * 5.0  # rows 6.. are rescued by their noise
    covs[2] = np.array([[1.0, 2.0], [2.0, 1.0]])  # indefinite
    with pytest.raises(NotPositiveDefiniteError) as err:
        batch_statistics(
            torch.tensor(x[4:]), torch.tensor(S[4:]), _mixture(weights, means, covs), backend=backend, max_pairs=3
        )
    assert (err.value.row, err.value.component) == (0, 2)
    with pytest.raises(NotPositiveDefiniteError) as err:
        log_densities(torch.tensor(x[5:]), torch.tensor(S[5:]), _mixture(weights, means, covs), backend=backend)
    assert (err.value.row, err.value.component) == (0, 2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fused", LOOPED, "unrolled", "compiled"])
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-4)])
def test_fast_pass_matches_the_reference_on_hard_inputs(backend, dtype, rtol, request):
    backend = _kernel(backend, request)
    x, S, weights, means, covs = hard_kernel_problem(np.random.default_rng(4))
    weights[3] = 0.0  # a frozen component: log alpha = -inf
    args = [torch.tensor(a, dtype=dtype) for a in (x, S)] + [_mixture(weights, means, covs).to(dtype=dtype)]
    reference = batch_statistics(*args, backend="linalg")
    fast = batch_statistics(*args, backend=backend, max_pairs=1000)
    for name in ("q", "U", "UU", "P"):
        got, want = (getattr(stats, name).double().numpy() for stats in (fast, reference))
        assert max_row_relative_error(got, want) < rtol, name  # the frozen component's rows are exactly 0
    loglik_fast, dens_fast = log_densities(*args, backend=backend)
    loglik_ref, dens_ref = log_densities(*args, backend="linalg")
    np.testing.assert_allclose(dens_fast.double().numpy(), dens_ref.double().numpy(), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(loglik_fast.double().numpy(), loglik_ref.double().numpy(), rtol=rtol)


@pytest.mark.parametrize("backend", ["fused", LOOPED])
@pytest.mark.parametrize("scale", [1e-16, 1e-10, 1e-4, 1e4, 1e9, 1e15])
def test_float32_log_densities_hold_at_data_scales_from_1e_minus_16_to_1e15(backend, scale, request):
    """det T from float32 pivots: products of two of them underflowed float32 below scales of ~3e-10 (NaN
    log-likelihoods at 1e-12) and overflowed above ~1e9; the float64 LAPACK pass is the reference, within
    float32's rounding of log-densities up to ~300 in size (-d log(scale) at 1e-16; T's condition number,
    kept below 1e3 by the noise, adds little)."""
    backend = _kernel(backend, request)
    rng = np.random.default_rng(11)
    n, k, d = 300, 4, 7
    x = rng.normal(size=(n, d)) * scale
    S = np.zeros((n, d, d))
    S[:, np.arange(d), np.arange(d)] = (rng.uniform(0.1, 1.0, size=(n, d)) * scale) ** 2
    covs = random_spd(rng, k, d) * scale**2
    mixture = _mixture(rng.dirichlet(np.ones(k)), rng.normal(size=(k, d)) * scale, covs)
    want, _ = log_densities(torch.tensor(x), torch.tensor(S), mixture, backend="linalg")
    x32, S32 = torch.tensor(x, dtype=torch.float32), torch.tensor(S, dtype=torch.float32)
    got, _ = log_densities(x32, S32, mixture.to(dtype=torch.float32), backend=backend)
    np.testing.assert_allclose(got.double().numpy(), want.numpy(), rtol=0, atol=2e-4)


CALLS = []


def toy_chunk(x, S, mixture, R, with_stats, row_offset, **extra):
    """A backend defined in this test alone: the LAPACK pass, counted."""
    CALLS.append(len(x))
    return linalg_chunk(x, S, mixture, R, with_stats, row_offset, **extra)


def test_a_backend_is_one_module_and_one_row(monkeypatch):
    """A row naming a chunk function outside the package is a backend: the settings accept it, a fit runs
    on it in chunks of its pairs, and its results are its function's."""
    monkeypatch.setitem(kernel.TABLE, "toy", kernel.Backend("toy", "test_kernel.toy_chunk", {"cpu": 40}))
    rng = np.random.default_rng(9)
    x, S, weights, means, covs = kernel_problem(rng, n=50, k=4, d=3)
    args = (torch.tensor(x), torch.tensor(S), _mixture(weights, means, covs))
    got, want = batch_statistics(*args, backend="toy"), batch_statistics(*args, backend="linalg", max_pairs=40)
    assert CALLS == [10] * 5  # 40 pairs a chunk at K = 4
    for name in ("q", "U", "UU", "P"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
    model = XDGMM(2, "em", backend="toy", epochs=2, tol=None, random_state=0).fit(x, Xcov=S)
    assert model.backend_ == "toy" and len(CALLS) > 5
    with pytest.raises(ValueError, match="unknown backend 'tiny': choose one of auto, fused, .*toy"):
        XDGMM(2, backend="tiny").fit(x, Xcov=S)


@pytest.mark.parametrize("backend", ["auto", "fused", "unrolled", "compiled"])
def test_projected_batches_take_the_lapack_path_whatever_is_requested(backend, monkeypatch):
    """The unrolled kernels handle R = I only; the dispatcher, the one place the choice is made, sends
    projected batches to the LAPACK path (the compiled kernel is never built for them)."""
    import scalable_xd.kernel.unrolled as unrolled

    monkeypatch.setattr(unrolled, "_compiled_terms", None)
    rng = np.random.default_rng(5)
    x, S, weights, means, covs = kernel_problem(rng, n=4, k=2, d=2)
    R = torch.tensor(rng.normal(size=(4, 2, 2)))
    args = (torch.tensor(x), torch.tensor(S), _mixture(weights, means, covs), R)
    got, want = batch_statistics(*args, backend=backend), batch_statistics(*args, backend="linalg")
    for name in ("q", "U", "UU", "P"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["fused", LOOPED, SPLIT])
@pytest.mark.parametrize("d, k", [(1, 3), (2, 17), (7, 40)])
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-4)])
def test_fused_kernel_matches_the_lapack_path_with_weights_draws_and_criteria(backend, d, k, dtype, rtol, request):
    """K not a multiple of the kernel's tile (padded components must contribute nothing), D = 1 (one pivot),
    per-point weights, sampled one-hot assignments and the split-and-merge sums, against the LAPACK path."""
    backend = _kernel(backend, request)
    rng = np.random.default_rng(6)
    x, S, weights, means, covs = kernel_problem(rng, n=300, k=k, d=d)
    weights[1] = 0.0  # frozen
    args = [torch.tensor(a, dtype=dtype) for a in (x, S)] + [_mixture(weights, means, covs).to(dtype=dtype)]
    extra = {"point_weights": torch.tensor(rng.uniform(0.5, 2.0, 300), dtype=dtype), "with_criteria": True}
    for draws in (None, torch.tensor(rng.uniform(size=300), dtype=dtype)):
        fast = batch_statistics(*args, backend=backend, uniforms=draws, **extra)
        reference = batch_statistics(*args, backend="linalg", uniforms=draws, **extra)
        for name in ("q", "U", "UU", "P"):
            got, want = (getattr(stats, name).double().numpy() for stats in (fast, reference))
            assert max_row_relative_error(got, want) < rtol, (name, draws is None)
        for name in ("overlap", "r_log_r", "r_log_n"):
            got, want = (getattr(stats.criteria, name).double().numpy() for stats in (fast, reference))
            assert max_row_relative_error(got, want) < 10 * rtol, name
        assert fast.n_points == pytest.approx(reference.n_points)
        assert float(fast.loglik) == pytest.approx(float(reference.loglik), rel=rtol)


@pytest.mark.parametrize("d", [13, 20, 32])
def test_above_the_unrolled_bound_the_fused_kernel_loops_over_d(d):
    """Beyond ``UNROLLED_MAX_DIM`` the kernel's source does not grow with D (an unrolled D = 20 kernel took
    four minutes to compile), and it still equals the LAPACK path."""
    assert d > fused_layout.UNROLLED_MAX_DIM
    rng = np.random.default_rng(8)
    x, S, weights, means, covs = kernel_problem(rng, n=100, k=5, d=d)
    args = [torch.tensor(x), torch.tensor(S), _mixture(weights, means, covs)]
    fast, reference = (batch_statistics(*args, backend=b) for b in ("fused", "linalg"))
    for name in ("q", "U", "UU", "P"):
        got, want = (getattr(stats, name).double().numpy() for stats in (fast, reference))
        assert max_row_relative_error(got, want) < 1e-10, name
    looped_sizes = [len(fused_source._source(n, True, "np.float64")) for n in (fused_layout.UNROLLED_MAX_DIM + 1, d)]
    assert (
        looped_sizes[1]
        < 1.1 * looped_sizes[0]
        < len(fused_source._source(fused_layout.UNROLLED_MAX_DIM, True, "np.float64"))
    )


@pytest.mark.parametrize("k, tile", [(3, 4), (5, 8), (17, 16)])
def test_the_looped_kernel_takes_the_narrowest_tile_that_holds_k_and_equals_the_lapack_path(k, tile):
    """Above ``UNROLLED_MAX_DIM`` a tile's lanes cost their time padding or not, so few components take a
    narrower tile (``tile_for``); any tile's sums, padding lanes or several tiles, equal the LAPACK path's.
    The unrolled form keeps tiles of 16 (its lanes are vectorised)."""
    assert (
        fused_layout.tile_for(k, 13) == tile
        and fused_layout.tile_for(k, fused_layout.UNROLLED_MAX_DIM) == fused_layout.TILE
    )
    x, S, weights, means, covs = kernel_problem(np.random.default_rng(9), n=60, k=k, d=13)
    args = [torch.tensor(x), torch.tensor(S), _mixture(weights, means, covs)]
    fast, reference = (batch_statistics(*args, backend=b) for b in ("fused", "linalg"))
    for name in ("q", "U", "UU", "P"):
        got, want = (getattr(stats, name).double().numpy() for stats in (fast, reference))
        assert max_row_relative_error(got, want) < 1e-10, name
    assert float(fast.loglik) == pytest.approx(float(reference.loglik), rel=1e-12)


def _own_cache_environ() -> dict:
    """This process's environment without NUMBA_CACHE_DIR, which moves numba's cache files out of the kernels'
    folder (a user's setting: the tests read the files where the library puts them by default)."""
    return {name: value for name, value in os.environ.items() if name != "NUMBA_CACHE_DIR"}


@pytest.mark.slow
def test_fused_kernel_is_cached_on_disk_for_the_next_process(tmp_path):
    """A second process finds the compiled kernel in the cache folder instead of compiling it again."""
    script = (
        "import time, torch; from scalable_xd.kernel.dispatch import log_densities; "
        "from scalable_xd.mixture import Mixture; m = Mixture(torch.ones(2) / 2, torch.zeros(2, 2), "
        "torch.eye(2).expand(2, 2, 2)); x = torch.zeros(3, 2); S = torch.eye(2).expand(3, 2, 2); "
        "t = time.perf_counter(); log_densities(x, S, m, backend='fused'); print(time.perf_counter() - t)"
    )
    env = {**_own_cache_environ(), "SCALABLE_XD_CACHE": str(tmp_path)}
    seconds = [
        float(
            subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
        )
        for _ in range(2)
    ]
    assert len(list((tmp_path / "kernels").glob("fused_d2_float32_densities_*.py"))) == 1
    assert list((tmp_path / "kernels" / "__pycache__").glob("*.nbi"))
    assert seconds[1] < seconds[0] / 3, seconds


_SUMS_DIGESTS = """
import hashlib, numpy as np, torch
from scalable_xd.kernel.dispatch import batch_statistics
from scalable_xd.mixture import Mixture
rng = np.random.default_rng(0)
x, S = torch.tensor(rng.normal(size=(10_000, 3))), torch.eye(3, dtype=torch.float64).expand(10_000, 3, 3) * 0.1
a = torch.tensor(rng.normal(size=(5, 3, 3)))
mixture = Mixture(torch.full((5,), 0.2, dtype=torch.float64), torch.tensor(rng.normal(size=(5, 3))),
                  a @ a.transpose(1, 2) + 0.1 * torch.eye(3, dtype=torch.float64))
for threads in (2, 1):  # 50,000 pairs: the threaded kernel on two threads, the serial one on one
    torch.set_num_threads(threads)
    stats = batch_statistics(x, S, mixture, backend="fused")
    sums = b"".join(getattr(stats, name).numpy().tobytes() for name in ("q", "U", "UU", "P"))
    print(hashlib.sha1(sums).hexdigest())
"""


@pytest.mark.slow
@pytest.mark.parametrize("no_fast_math", ["0", "1"], ids=["fast_math", "no_fast_math"])
def test_a_kernel_loaded_from_the_cache_gives_the_bits_of_the_process_that_compiled_it(tmp_path, no_fast_math):
    """numba optimises a threaded kernel's body again when it builds what it writes to the cache: with fast
    math's contraction and reassociation LLVM then fuses and groups other sums than in the process that
    compiled it (2e-16 relative in U here, 2.3e-13 in UU on collapsed components). The threaded kernel runs
    as the cache holds it in every process (``fused.CacheLoadedKernel``), so the first process (compiling)
    and the second (loading) give the same bits on two threads, and on one (the serial kernel). With
    SCALABLE_XD_NO_FAST_MATH=1 each operation is rounded as written: two threads and one agree too."""
    env = {**_own_cache_environ(), "SCALABLE_XD_CACHE": str(tmp_path), "NUMBA_NUM_THREADS": "2"}
    env["SCALABLE_XD_NO_FAST_MATH"] = no_fast_math
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", _SUMS_DIGESTS], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    compiled, loaded = run(), run()
    assert list((tmp_path / "kernels" / "__pycache__").glob("*.nbi"))
    assert compiled == loaded, (compiled, loaded)
    if no_fast_math == "1":
        assert len(set(compiled)) == 1, compiled


@pytest.mark.slow
@pytest.mark.skipif(os.cpu_count() < 2, reason="the threaded kernel runs on two or more threads")
def test_a_threaded_kernel_that_cannot_compile_in_a_new_process_compiles_here_and_says_so(
    tmp_path, monkeypatch, caplog
):
    """Where the process that compiles the threaded kernel for the cache cannot run, the kernel compiles in
    the process, as numba would, with a warning that its sums may differ from a later process's."""
    monkeypatch.setenv("SCALABLE_XD_CACHE", str(tmp_path))
    monkeypatch.setattr(fused.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, b"", b"no room"))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    fused.compiled_module.cache_clear()
    try:
        rng = np.random.default_rng(3)
        x, S, weights, means, covs = kernel_problem(rng, n=12_000, k=3, d=2)  # 36,000 pairs: threaded
        mixture = _mixture(weights, means, covs)
        with caplog.at_level(logging.WARNING, logger="scalable_xd"):
            got = batch_statistics(torch.tensor(x), torch.tensor(S), mixture, backend="fused")
        want = batch_statistics(torch.tensor(x), torch.tensor(S), mixture, backend="linalg")
    finally:
        fused.compiled_module.cache_clear()
    assert "could not be compiled in a new process" in caplog.text and "no room" in caplog.text
    assert torch.allclose(got.UU, want.UU, rtol=1e-10)


def test_auto_falls_back_to_the_torch_kernel_with_a_message_without_numba(monkeypatch):
    import scalable_xd.kernel.dispatch as dispatch

    monkeypatch.setattr(dispatch, "_have_numba", lambda: False)
    dispatch._numba_or_say_why.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="numba is not installed"):
            assert dispatch.choose_backend("auto", None, torch.device("cpu")) == "unrolled"
        with pytest.raises(ImportError, match="pip install numba"):
            dispatch.choose_backend("fused", None)
    finally:
        monkeypatch.undo()
        dispatch._numba_or_say_why.cache_clear()
    assert dispatch.choose_backend("auto", None, torch.device("cpu")) == "fused"
    assert dispatch.choose_backend("auto", None, torch.device("meta")) == "unrolled"


@pytest.mark.parametrize("backend", ["fused", LOOPED, SPLIT])
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-4)])
def test_missing_entries_in_one_fused_pass_equal_a_pass_per_pattern(backend, dtype, rtol, request):
    """The fused kernel marginalises each star's missing entries inside one pass (T_oo (+) I, the
    normalisation by the observed count); the other kernels run a pass per pattern of observed entries on
    the mixture's marginal. Densities and sums agree, with point weights (and sampled assignments in
    float64), for stars with every pattern, none observed included, and NaN in the missing entries."""
    backend = _kernel(backend, request)
    rng = np.random.default_rng(17)
    x, S, weights, means, covs = kernel_problem(rng, n=400, k=5, d=5)
    observed = torch.tensor(rng.random(x.shape) > 0.3)
    observed[:4] = False
    x[~observed.numpy()] = np.nan
    mixture = _mixture(weights, means, covs)
    xt, St = torch.tensor(x, dtype=dtype), torch.tensor(S, dtype=dtype)
    extra = {"point_weights": torch.tensor(rng.uniform(0.5, 2.0, size=len(x)), dtype=dtype)}
    if dtype == torch.float64:
        extra["uniforms"] = torch.tensor(rng.random(len(x)))
    per_pattern = log_densities(xt, St, mixture, backend="unrolled", observed=observed)
    for a, b in zip(per_pattern, log_densities(xt, St, mixture, backend=backend, observed=observed)):
        assert torch.allclose(b.double(), a.double(), rtol=rtol, atol=rtol)
    want = batch_statistics(xt, St, mixture, backend="unrolled", observed=observed, **extra)
    got = batch_statistics(xt, St, mixture, backend=backend, observed=observed, **extra)
    for name in ("q", "U", "UU", "P"):
        a, b = getattr(want, name).double(), getattr(got, name).double()
        assert float((a - b).abs().max()) <= rtol * float(a.abs().max()), name
    assert float(got.loglik) == pytest.approx(float(want.loglik), rel=rtol)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fused", LOOPED, TRITON, "unrolled", "linalg"])
def test_float32_chunks_beyond_its_precision_are_computed_in_float64(backend, caplog, request):
    """A component with condition number 1e11 and stars with tiny noise in its thin directions: float32's
    Cholesky of V_j + S_i fails where float64's does not. The pass then equals the float64 pass (rounded
    to float32) instead of stopping the fit; a covariance that is indefinite still raises."""
    backend = _kernel(backend, request)
    rng = np.random.default_rng(7)
    x, S, weights, means, covs = float32_unfactorisable_problem(rng)
    mixture = _mixture(weights, means, covs)
    x32, S32 = torch.tensor(x, dtype=torch.float32), torch.tensor(S, dtype=torch.float32)
    dispatch._say_float64_once.cache_clear()  # the warning is said once a process
    T32 = torch.tensor(covs[2], dtype=torch.float32) + S32  # the premise: float32 alone cannot factorise them
    assert (torch.linalg.cholesky_ex(T32).info > 0).any()
    exact = batch_statistics(torch.tensor(x), torch.tensor(S), mixture, backend="linalg")
    with caplog.at_level(logging.WARNING, logger="scalable_xd"):
        got = batch_statistics(x32, S32, mixture, backend=backend, max_pairs=200)
        loglik, _ = log_densities(x32, S32, mixture, backend=backend)
    assert got.q.dtype == torch.float32 and loglik.dtype == torch.float32
    for name in ("q", "U", "UU", "P"):
        assert max_row_relative_error(getattr(got, name).numpy(), getattr(exact, name).numpy()) < 1e-5, name
    assert "computed in float64" in caplog.text
    covs[2] = np.diag([1.0, -1.0, 1, 1, 1, 1, 1])
    with pytest.raises(NotPositiveDefiniteError):
        batch_statistics(x32, S32, _mixture(weights, means, covs), backend=backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_plain_pass_equals_the_general_pass_to_the_bit_and_declines_what_it_does_not_take(dtype):
    """``fused.PlainPass`` is ``fused_chunk`` with its set-up settled once: the same kernel on the same
    arrays, so the same sums to the bit, on one thread or two (6,400 x 5 pairs: past ``PARALLEL_PAIRS``). It
    returns None, so that the general pass takes the batch, for a weighted, projected or too large batch and
    for one in which float32 cannot factorise a pair (which the general pass computes in float64)."""
    rng = np.random.default_rng(3)
    x, S, weights, means, covs = kernel_problem(rng, n=6400, k=5, d=7)
    mixture = _mixture(weights, means, covs)
    xt, St = torch.tensor(x, dtype=dtype), torch.tensor(S, dtype=dtype)
    plain = fused.PlainPass(7, 5, dtype, max_pairs=1 << 20)
    for got, want in _plain_and_general_on_one_thread_then_two(plain, xt, St, mixture):
        assert got.n_points == want.n_points
        unsummed = plain.statistics(Batch(6400, xt, St, None, None), mixture, with_loglik=False)
        assert unsummed is not None and unsummed.loglik is None  # for updates that do not read it
        assert all(torch.equal(getattr(unsummed, name), getattr(want, name)) for name in ("q", "U", "UU", "P"))
    ones = torch.ones(6400, dtype=dtype)
    assert plain.statistics(Batch(6400, xt, St, None, ones), mixture) is None
    assert plain.statistics(Batch(6400, xt, St, torch.eye(7, dtype=dtype).expand(6400, 7, 7), None), mixture) is None
    assert fused.PlainPass(7, 5, dtype, max_pairs=1000).statistics(Batch(6400, xt, St, None, None), mixture) is None
    if dtype == torch.float32:
        q, _ = np.linalg.qr(rng.normal(size=(7, 7)))
        covs[2] = (q * np.geomspace(1e-7, 1e4, 7)) @ q.T
        tiny = torch.eye(7, dtype=dtype) * torch.tensor(rng.uniform(1e-10, 1e-8, size=(6400, 1, 1)), dtype=dtype)
        assert plain.statistics(Batch(6400, xt, tiny, None, None), _mixture(weights, means, covs)) is None


def test_a_chunk_is_summed_in_blocks_set_by_its_size_and_the_pool_alone():
    """Four blocks a thread of the pool for a large chunk, fewer for a minibatch (at least ``BLOCK_ROWS`` rows
    a block), a multiple of the pool (every thread takes the same share) and never more than the points;
    the threads in use play no part, so a chunk's sums are the same on one thread or several."""
    assert fused.blocks_for(500, 2) == 4 and fused.blocks_for(100_000, 2) == 8
    assert fused.blocks_for(500, 16) == 16 and fused.blocks_for(3, 16) == 3 and fused.blocks_for(0, 2) == 1
    for pool in (1, 2, 3, 8, 16):
        for n in range(1, 5000, 7):
            blocks = fused.blocks_for(n, pool)
            assert 1 <= blocks <= min(n, 4 * pool) and (blocks % pool == 0 or blocks == n)
            assert blocks == 4 * pool or blocks == n or n // blocks >= fused.BLOCK_ROWS or blocks == pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_minibatch_in_fewer_blocks_is_the_general_pass_to_the_bit_on_one_thread_or_two(dtype):
    """A 500-star batch at K = 64 (past ``PARALLEL_PAIRS``) is summed in fewer blocks than a large chunk: the
    plain pass and the general one sum it in the same blocks, so to the bit, on one thread or two; and the
    sums are the float64 reference's to rounding."""
    rng = np.random.default_rng(11)
    x, S, weights, means, covs = kernel_problem(rng, n=500, k=64, d=7)
    mixture = _mixture(weights, means, covs)
    xt, St = torch.tensor(x, dtype=dtype), torch.tensor(S, dtype=dtype)
    plain = fused.PlainPass(7, 64, dtype, max_pairs=1 << 20)
    reference = batch_statistics(torch.tensor(x), torch.tensor(S), mixture, backend="linalg")
    for got, _ in _plain_and_general_on_one_thread_then_two(plain, xt, St, mixture):
        for name in ("q", "U", "UU", "P", "loglik"):
            scale = getattr(reference, name).abs().max()  # float32's rounding over 500 stars, relative
            assert (getattr(got, name) - getattr(reference, name)).abs().max() <= 1e-4 * scale, name


def _plain_and_general_on_one_thread_then_two(plain, xt, St, mixture):
    """Yield (the plain pass's Statistics, the general fused pass's) of the plain batch (xt, St), on one
    thread then two (torch's count restored after), having checked that they are the same to the bit."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            want = batch_statistics(xt, St, mixture, backend="fused")
            got = plain.statistics(Batch(len(xt), xt, St, None, None), mixture)
            assert got is not None
            for name in ("q", "U", "UU", "P", "loglik"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (threads, name)
            yield got, want
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_plain_pass_reads_rows_in_memory_in_place_as_it_reads_them_gathered(dtype):
    """A batch of rows of arrays in memory (``Batch.in_memory``: shuffled row numbers, the data in float64
    or float32) is read in place, cast to the pass's dtype as it is read: the same numbers as the batch
    gathered and converted first, so for dense noise the same sums to the bit. Diagonal variances and
    compact noise (sigma and correlations, S built in the pass's dtype either way) give the same sums to
    rounding: the kernel, seeing how S is made, folds the zeros away or fuses S's products into its own
    sums (float32's 1e-5 of a component's largest entry at most, on any CPU's vector width, against the 1e-3
    it would take to be another row's)."""
    rng = np.random.default_rng(5)
    x, S, weights, means, covs = kernel_problem(rng, n=3000, k=5, d=7)
    mixture = _mixture(weights, means, covs)
    rows = rng.permutation(3000)[:700]
    plain = fused.PlainPass(7, 5, dtype, max_pairs=1 << 20)
    pairs = [(1, 0), (2, 1), (6, 3)]
    sigma = np.sqrt(np.diagonal(S, axis1=1, axis2=2))
    corr = rng.uniform(-0.5, 0.5, size=(3000, len(pairs)))
    for data_dtype in (np.float64, np.float32):
        X = x.astype(data_dtype)
        compact = CompactCovariance(sigma.astype(data_dtype), corr.astype(data_dtype), pairs)
        variances = np.ascontiguousarray(sigma**2, data_dtype)
        forms = {  # the noise as the kernel reads it in place, and the batch's S gathered in the pass's dtype
            "dense": (S.astype(data_dtype), torch.tensor(S.astype(data_dtype)[rows], dtype=dtype)),
            "diagonal": (variances, torch.diag_embed(torch.tensor(variances[rows], dtype=dtype))),
            "compact": (
                (compact.sigma.numpy(), compact.corr.numpy(), compact.correlation_columns()),
                compact.batch(torch.as_tensor(rows), "cpu", dtype),
            ),
        }
        for form, (noise, gathered) in forms.items():
            want = plain.statistics(Batch(700, torch.tensor(X[rows], dtype=dtype), gathered, None, None), mixture)
            got = plain.statistics(Batch(700, None, None, None, None, None, RowsInMemory(X, noise, rows)), mixture)
            assert got is not None and want is not None and got.n_points == 700
            for name in ("q", "U", "UU", "P", "loglik"):
                a, b = getattr(got, name), getattr(want, name)
                if form == "dense":
                    assert torch.equal(a, b), (data_dtype, name)
                else:
                    # each star's posterior covariance B = V - V T^-1 V carries V's rounding, not its own: the
                    # tolerance is relative to each component's largest entry, not to the entry's value
                    tol = 1e-5 if dtype == torch.float32 else 1e-12
                    scale = b.reshape(len(b), -1).abs().amax(1).reshape(-1, *[1] * (b.dim() - 1)) if b.dim() else b
                    assert ((a - b).abs() <= tol * scale.abs()).all(), (form, name)
    empty = RowsInMemory(x, S, rows[:0])  # no rows to read (a batch a data-parallel share left empty): declined
    assert plain.statistics(Batch(0, None, None, None, None, None, empty), mixture) is None

"""The Triton kernel, run on the CPU by Triton's interpreter, against the LAPACK path (small inputs: the
interpreter runs each program as numpy, slowly). On a GPU the same kernels are compiled (tests/fit/test_cuda.py).
Failed factorisations and the float64 retry are tested with every backend in tests/kernel/test_kernel.py."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import hard_kernel_problem, kernel_problem, max_row_relative_error

import scalable_xd.fit.driver
import scalable_xd.fitted_model
from scalable_xd import XDGMM
from scalable_xd.kernel import dispatch
from scalable_xd.kernel.dispatch import batch_statistics, log_densities
from scalable_xd.mixture import Mixture

pytestmark = pytest.mark.slow  # Triton's interpreter on the CPU, and compiles for a GPU

pytest.importorskip("triton", reason="triton is not installed (Linux x86-64 wheels only)")


if torch.cuda.is_available():
    pytest.skip("on a GPU the kernel is tested compiled, on CUDA tensors (test_cuda.py)", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1":
    reason = "TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does)"
    pytest.skip(reason, allow_module_level=True)


def _mixture(weights, means, covs, dtype=torch.float64):
    return Mixture(*(torch.tensor(a) for a in (weights, means, covs))).to(dtype=dtype)


def _assert_sums_match(got, want, rtol):
    for name in ("q", "U", "UU", "P"):
        assert max_row_relative_error(getattr(got, name).double().numpy(), getattr(want, name).numpy()) < rtol, name


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-4)])
def test_the_pass_matches_the_reference_on_hard_inputs(dtype, rtol):
    """Entries missing with variance 1e12, noise variances of 1e-16, condition numbers of 1e6 and a frozen
    component; 150 stars, not a multiple of the kernel's block of 128."""
    x, S, weights, means, covs = hard_kernel_problem(np.random.default_rng(4), n=150, k=6)
    weights[3] = 0.0  # frozen: log alpha = -inf
    args = [torch.tensor(a, dtype=dtype) for a in (x, S)] + [_mixture(weights, means, covs, dtype)]
    reference = batch_statistics(*args, backend="linalg").double()
    _assert_sums_match(batch_statistics(*args, backend="triton"), reference, rtol)
    loglik, dens = log_densities(*args, backend="triton")
    loglik_ref, dens_ref = log_densities(*args, backend="linalg")
    np.testing.assert_allclose(dens.double().numpy(), dens_ref.double().numpy(), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(loglik.double().numpy(), loglik_ref.double().numpy(), rtol=rtol)


@pytest.mark.parametrize("d, k", [(1, 3), (3, 5), (7, 4)])
def test_the_pass_matches_with_weights_draws_and_criteria_in_every_dimension(d, k):
    rng = np.random.default_rng(6)
    x, S, weights, means, covs = kernel_problem(rng, n=140, k=k, d=d)
    weights[1] = 0.0
    args = [torch.tensor(x), torch.tensor(S), _mixture(weights, means, covs)]
    extra = {"point_weights": torch.tensor(rng.uniform(0.5, 2.0, 140)), "with_criteria": True}
    for draws in (None, torch.tensor(rng.uniform(size=140))):
        got = batch_statistics(*args, backend="triton", uniforms=draws, **extra)
        want = batch_statistics(*args, backend="linalg", uniforms=draws, **extra)
        _assert_sums_match(got, want, 1e-12)
        for name in ("overlap", "r_log_r", "r_log_n"):
            assert max_row_relative_error(getattr(got.criteria, name), getattr(want.criteria, name)) < 1e-11, name
        assert got.n_points == pytest.approx(want.n_points)
        assert float(got.loglik) == pytest.approx(float(want.loglik), rel=1e-12)


def test_the_same_input_gives_the_same_bits():
    x, S, weights, means, covs = kernel_problem(np.random.default_rng(8), n=200, k=3, d=4)
    args = [torch.tensor(x, dtype=torch.float32), torch.tensor(S, dtype=torch.float32)]
    first, second = (batch_statistics(*args, _mixture(weights, means, covs), backend="triton") for _ in range(2))
    for name in ("q", "U", "UU", "P"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name


def test_a_small_fit_with_the_triton_kernel_equals_the_lapack_one(monkeypatch):
    rng = np.random.default_rng(9)
    x, S, weights, means, covs = kernel_problem(rng, n=200, k=3, d=2)
    settings = dict(n_components=3, method="minibatch_em", epochs=2, batch_size=100, dtype="float64")
    settings.update(device="cpu", random_state=0, means_init=means)
    fits = {}
    for backend in ("triton", "linalg"):
        for module in (scalable_xd.fit.driver, scalable_xd.fitted_model):
            monkeypatch.setattr(module, "fit_backend", lambda compile, device, b=backend: b)
        fits[backend] = XDGMM(**settings).fit(x, Xcov=S)
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(fits["triton"], attr), getattr(fits["linalg"], attr), rtol=1e-10)


def test_without_the_interpreter_the_cpu_is_refused_with_the_way_out(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1.*use backend 'fused' on the CPU"):
        dispatch.choose_backend("triton", None, torch.device("cpu"))


# Compiling for a Hopper GPU (sm_90) needs no GPU: Triton's compiler and the ptxas it ships run on the CPU.
# The interpreter accepts code that the compiler refuses (a module global read inside a kernel, say), so the
# kernels are also compiled here, in a child process that has not set TRITON_INTERPRET.
_COMPILE_FOR_HOPPER = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from scalable_xd.kernel.triton_pass import kernels

dim, element = int(sys.argv[1]), sys.argv[2]
densities, sums, combine = kernels(dim)
p = "*" + element
signatures = (
    (densities, dict(x_ptr=p, s_ptr=p, par_ptr=p, dens_ptr=p, fail_ptr="*i8", n="i32", n_all="i32", n_comp="i32",
                     BLOCK="constexpr")),
    (sums, dict(x_ptr=p, s_ptr=p, par_ptr=p, dens_ptr=p, ll_ptr=p, w_ptr=p, part_ptr=p, n="i32", n_all="i32",
                n_comp="i32", n_fits_comp="i32", WEIGHTED="constexpr", BLOCK="constexpr")),
    (combine, dict(dens_ptr=p, ll_ptr=p, n="i32", n_comp="i32", BLOCK_K="constexpr", BLOCK="constexpr")),
)
for kernel, signature in signatures:
    for weighted in (False, True) if "WEIGHTED" in signature else (None,):
        constexprs = {"BLOCK": 128, **({} if weighted is None else {"WEIGHTED": weighted})}
        if "BLOCK_K" in signature:
            constexprs.update(BLOCK_K=32, BLOCK=32)
        source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
"""


@pytest.mark.parametrize("dim, element", [(7, "fp32"), (7, "fp64"), (1, "fp32")])
def test_the_kernels_compile_for_a_hopper_gpu(dim, element, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER, str(dim), element], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_several_fits_in_one_launch_give_each_fit_its_pass_alone(dtype):
    """``ensemble_statistics``: F fits' batches, each under its own mixture, in one launch of each kernel,
    equal to each fit's ``triton_chunk`` to the bit (the same pairs' arithmetic in the same order, each
    fit's log-sum-exp a program of the same kernel over its own rows). A fit with a pair that does not
    factorise is flagged, the others not."""
    from scalable_xd.kernel.triton_pass import ensemble_statistics, triton_chunk

    rng = np.random.default_rng(12)
    fits = [kernel_problem(rng, n=150, k=4, d=3) for _ in range(3)]
    x = torch.cat([torch.as_tensor(f[0]) for f in fits]).to(dtype)
    S = torch.cat([torch.as_tensor(f[1]) for f in fits]).to(dtype)
    mixtures = [_mixture(*f[2:], dtype=dtype) for f in fits]
    stacked = [torch.stack(parts) for parts in zip(*(m.tensors() for m in mixtures))]
    together, failed = ensemble_statistics(x, S, *stacked)
    assert not failed.any()
    for s, (xs, Ss, *_) in enumerate(fits):
        _, _, alone = triton_chunk(
            torch.as_tensor(xs).to(dtype), torch.as_tensor(Ss).to(dtype), mixtures[s], None, True, 0
        )
        for name in ("q", "U", "UU", "P", "loglik"):
            assert torch.equal(getattr(together, name)[s], getattr(alone, name)), (s, name)
        assert together.n_points == alone.n_points
    stacked[2][1, 2] = -torch.eye(3, dtype=dtype)  # fit 1's component 2: V + S_i is not positive definite
    assert ensemble_statistics(x, S, *stacked)[1].tolist() == [False, True, False]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_fits, k", [(1, 5), (1, 70), (3, 37)])
def test_the_combine_kernel_takes_each_fits_log_sum_exp_as_torch_does(dtype, n_fits, k):
    """``combine`` against ``torch.logsumexp`` over each fit's rows of log alpha_j N_ij, K and the stars
    not multiples of its tile, values spread over 1e4 nats (the largest shift matters), a star whose
    components are all frozen (-inf: log p = -inf), one with a +inf entry (+inf), one fit's column far
    below the others; to a few float roundings (the sums' order differs)."""
    from scalable_xd.kernel.triton_pass import kernels, log_likelihoods

    n = 45
    dens = torch.from_numpy(np.random.default_rng(k).normal(scale=1e3, size=(n_fits * k, n))).to(dtype)
    dens[:k, 3] = -torch.inf
    dens[-1, 7] = torch.inf
    dens[:, 11] -= 5e3
    loglik = log_likelihoods(kernels(3)[2], dens, n_fits)
    expected = torch.logsumexp(dens.view(n_fits, k, n), dim=1)
    assert loglik[0, 3] == -torch.inf and loglik[-1, 7] == torch.inf
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(loglik))
    rtol = 1e-13 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(loglik[finite], expected[finite], rtol=rtol, atol=0)

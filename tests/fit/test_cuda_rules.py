"""The minibatch rules' updates as Triton kernels (fit/rules/online_em_triton.py, fit/rules/sgd_triton.py),
online EM's and SGD's, against the torch updates that define them: compiled on a GPU where there is one, else
through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import random_spd

from scalable_xd.fit.families.sgd import SGD
from scalable_xd.fit.rules import forms, online_em_triton, sgd_triton
from scalable_xd.fit.rules.em import FixedParameters, regularised
from scalable_xd.fit.rules.online_em import online_em_update
from scalable_xd.kernel.dispatch import batch_statistics
from scalable_xd.mixture import Mixture

pytestmark = pytest.mark.slow  # Triton's interpreter on the CPU

pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET=1 must be set before triton is imported", allow_module_level=True)


def _case(seed: int, k: int, d: int, scale: float):
    """A running state of ``k`` components at feature scale ``scale`` and a float32 batch's statistics from
    the E-step mixture of that state."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.ones(k))
    state = Mixture(
        torch.from_numpy(weights),
        torch.from_numpy(rng.normal(scale=2 * scale, size=(k, d))),
        torch.from_numpy(random_spd(rng, k, d, scale=scale**2)),
    )
    x = torch.from_numpy(rng.normal(scale=2 * scale, size=(300, d))).float()
    S = torch.diag_embed(torch.from_numpy(rng.uniform(0.01, 0.3, size=(300, d)) * scale**2)).float()
    return state, x, S


def _kernel_update(state, stats, step, w, fixed, data_size):
    """(new state, E-step mixture, suspect flags) from the kernel on ``DEVICE``, written into copies of
    ``state``, returned on the CPU."""
    new, e_step = (Mixture(*(t.to(DEVICE, copy=True) for t in state.tensors())) for _ in range(2))
    paper = data_size is None or w is None
    constants = torch.tensor([0.0 if paper else data_size, torch.finfo(torch.float64).tiny], dtype=torch.float64)
    on_device = [t.to(DEVICE) for t in (stats.q, stats.U, stats.UU, stats.P)]
    suspect = online_em_triton.online_em_step_in_place(
        new,
        e_step,
        type(stats)(stats.n_points, *on_device, stats.loglik, stats.criteria),
        torch.tensor(step, dtype=torch.float64, device=DEVICE),
        None if w is None else w.to(DEVICE),
        type(fixed)(*(t.to(DEVICE) for t in (fixed.weights, fixed.means, fixed.covariances, fixed.weight_values))),
        constants.to(DEVICE),
    )
    new, e_step = new.to("cpu"), e_step.to("cpu")
    if fixed.any():
        e_step = regularised(
            new, w, fixed, data_size
        )  # the fitter shares the weights so (families.minibatch_em.MinibatchEM)
    return new, e_step, suspect.cpu()


@pytest.mark.parametrize("d", [1, 3, 7])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e4])
@pytest.mark.parametrize("data_size, w", [(None, None), (None, 0.05), (5000.0, 0.05), (5000.0, None)])
def test_the_kernel_gives_the_torch_update(d, scale, data_size, w):
    k = 37  # not a multiple of the kernel's block: the last program is partly masked
    state, x, S = _case(d * 10 + 1, k, d, scale)
    w = None if w is None else torch.full((d,), w * scale**2, dtype=torch.float64)
    rng = np.random.default_rng(3)
    none = FixedParameters.none(k)
    fixed = FixedParameters(
        none.weights, torch.from_numpy(rng.random(k) < 0.3), torch.from_numpy(rng.random(k) < 0.3), none.weight_values
    )
    e_step = regularised(state, w, fixed, data_size)
    stats = batch_statistics(x, S, e_step.to(dtype=torch.float32), backend="fused")
    expected = online_em_update(state, stats.double(), 0.3, w, fixed, data_size)
    new, new_e_step, suspect = _kernel_update(state, stats, 0.3, w, fixed, data_size)
    # The same operations in the same order but for the products' sums (torch's matmul may block them) and,
    # compiled, fused multiply-adds: agreement to a few float64 roundings of each entry's scale.
    for ours, theirs in zip(
        [*new.tensors(), *new_e_step.tensors()],
        [*expected.tensors(), *regularised(expected, w, fixed, data_size).tensors()],
    ):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-12, atol=1e-12 * float(theirs.abs().max()))
    assert not suspect.any()
    assert not torch.equal(new.covariances, state.covariances)  # the update moved something


def test_the_kernel_flags_a_covariance_that_lost_its_factor():
    k, d = 5, 3
    state, x, S = _case(7, k, d, 1.0)
    stats = batch_statistics(x, S, state.to(dtype=torch.float32), backend="fused")
    # component 2's posterior scatter far below the current covariance: Vr + V (UU - P) V / q is indefinite
    P = stats.P.clone()
    P[2] += 1e3 * torch.eye(d)
    stats = type(stats)(stats.n_points, stats.q, stats.U, stats.UU, P, stats.loglik, stats.criteria)
    new, _, suspect = _kernel_update(state, stats, 1.0, None, FixedParameters.none(k), None)
    _, info = torch.linalg.cholesky_ex(new.covariances)
    assert suspect.tolist() == (info > 0).to(torch.int8).tolist() == [0, 0, 1, 0, 0]


def test_several_fits_in_one_launch_each_get_their_own_update():
    """F fits' updates in one launch (the CUDA engine's ensemble step), each with its own state, sums, step
    size, data size, W and fixed components, equal to each fit's update alone: the same arithmetic on the
    same numbers, so to the bit."""
    k, d = 6, 3  # K not a multiple of the block: a program takes components of two fits
    rng = np.random.default_rng(5)
    cases = [_case(20 + f, k, d, scale) for f, scale in enumerate((1.0, 1e-2, 30.0))]
    steps, sizes = [0.3, 0.05, 1.0], [None, 4000.0, 300.0]
    ws = [None, torch.full((d,), 1e-6), torch.full((d,), 2.0)]
    none = FixedParameters.none(k)
    fixes = [none] + [
        FixedParameters(
            none.weights,
            torch.from_numpy(rng.random(k) < 0.4),
            torch.from_numpy(rng.random(k) < 0.4),
            none.weight_values,
        )
        for _ in range(2)
    ]
    alone, stats_of = [], []
    for (state, x, S), step, size, w, fixed in zip(cases, steps, sizes, ws, fixes):
        stats = batch_statistics(x, S, regularised(state, w, fixed, size).to(dtype=torch.float32), backend="fused")
        stats_of.append(stats)
        alone.append(_kernel_update(state, stats, step, w, fixed, size)[:2])
    stacked = lambda parts: torch.stack(parts).to(DEVICE)  # noqa: E731
    new, e_step = (Mixture(*(stacked([c[0].tensors()[i] for c in cases]) for i in range(3))) for _ in range(2))
    summed = type(stats_of[0])(300, *(stacked([getattr(st, n) for st in stats_of]) for n in ("q", "U", "UU", "P")))
    constants = [
        [0.0 if size is None or w is None else size, torch.finfo(torch.float64).tiny] for size, w in zip(sizes, ws)
    ]
    suspect = online_em_triton.online_em_step_in_place(
        new,
        e_step,
        summed,
        torch.tensor(steps, dtype=torch.float64, device=DEVICE),
        stacked([torch.zeros(d, dtype=torch.float64) if w is None else w.double() for w in ws]),
        FixedParameters(
            *(stacked([getattr(f, n) for f in fixes]) for n in ("weights", "means", "covariances", "weight_values"))
        ),
        torch.tensor(constants, dtype=torch.float64, device=DEVICE),
    )
    assert suspect.shape == (3, k) and not suspect.any()
    for f, (state_alone, e_alone) in enumerate(alone):
        for ours, theirs in zip(new.tensors(), state_alone.tensors()):
            assert torch.equal(ours[f].cpu(), theirs)
        if not fixes[f].any():  # with fixed components the fitter shares the E-step's weights afterwards
            for ours, theirs in zip(e_step.tensors(), e_alone.tensors()):
                assert torch.equal(ours[f].cpu(), theirs)


def _sgd(state: Mixture, w, scaling: str, fixed: FixedParameters, lr: float = 0.05) -> SGD:
    """An SGD fitter in its first epoch, its Adam step count advanced to that of the step about to be taken
    on the device (``rules.sgd_graphed.GraphedAdam.prepare_step``'s part)."""
    fitter = SGD(state, w=w, lr=lr, lr_decay=0.1, decay_epoch=10, scaling=scaling, fixed=fixed)
    fitter.start_epoch(0)
    return fitter


def _adam_row(fitter: SGD) -> list[float]:
    """Adam's constants of the fitter's next step, its step count advanced (as ``prepare_step`` does)."""
    optimizer = fitter.optimizer
    optimizer.steps += 1
    return [*optimizer.corrections(), *optimizer.betas, optimizer.eps]


def _kernel_sgd_step(fitter: SGD, stats) -> None:
    """The kernels' step of ``fitter`` (its tensors on ``DEVICE``), its parameters, moments and mixture
    written in place."""
    params, optimizer, device = fitter.params, fitter.optimizer, fitter.mixture.means.device
    dim = params.means.shape[1]
    mixture = Mixture(*(t.clone() for t in fitter.mixture.tensors()))
    sgd_triton.sgd_step_in_place(
        tuple(params.tensors()),
        params.scale,
        (tuple(optimizer.exp_avg), tuple(optimizer.exp_avg_sq)),
        type(stats)(stats.n_points, *(t.to(device) for t in (stats.q, stats.U, stats.UU, stats.P))),
        torch.tensor([_adam_row(fitter)], dtype=torch.float64, device=device),
        torch.ones(dim, dtype=torch.float64, device=device) if fitter.w is None else fitter.w,
        torch.tensor(fitter.w is not None, dtype=torch.int8, device=device),
        params.fixed,
        (params.initial.means, params.initial.covariances),
        mixture,
    )
    fitter.mixture = mixture


def _random_fixed(rng, k: int, device=None) -> FixedParameters:
    none = FixedParameters.none(k, device)
    means, covariances = (torch.from_numpy(rng.random(k) < 0.3).to(device) for _ in range(2))
    return FixedParameters(none.weights, means, covariances, none.weight_values)


@pytest.mark.parametrize("d, scaling", [(1, "none"), (3, "spread"), (7, "component"), (7, "none")])
@pytest.mark.parametrize("scale", [1e-3, 1e4])
@pytest.mark.parametrize("w", [None, 0.05])
def test_the_sgd_kernels_give_the_torch_gradient_and_adams_step(d, scaling, scale, w, monkeypatch):
    """Three steps of SGD on the kernels against the torch gradient (``CholeskyParameters.loss_gradients``)
    and ``Adam.step``: parameters, Adam's moments and the mixture, at feature scales 1e-3 and 1e4, with the
    penalty and without, some means and covariances fixed, in each of SGD's units."""
    monkeypatch.setattr(forms, "compiled", lambda fitter, device: None)  # the torch update on the CPU
    k = 37  # not a multiple of the kernel's block: the last program is partly masked
    state, x, S = _case(d * 10 + 2, k, d, scale)
    w = None if w is None else w * scale**2
    fixed = _random_fixed(np.random.default_rng(d), k)
    on_torch = _sgd(state, w, scaling, fixed)
    on_kernels = _sgd(state.to(DEVICE), w, scaling, _random_fixed(np.random.default_rng(d), k, DEVICE))
    for rows in (slice(0, 100), slice(100, 200), slice(200, 300)):
        stats = batch_statistics(x[rows], S[rows], on_torch.mixture.to(dtype=torch.float32), backend="fused")
        on_torch.observe(stats)
        _kernel_sgd_step(on_kernels, stats)
    # The same operations in the same order but for the products' and the softmax's sums (torch may block
    # them) and, compiled, fused multiply-adds: agreement to a few float64 roundings of each entry's scale.
    ours = [*on_kernels.mixture.tensors(), *on_kernels.params.tensors()]
    ours += [*on_kernels.optimizer.exp_avg, *on_kernels.optimizer.exp_avg_sq]
    theirs = [*on_torch.mixture.tensors(), *on_torch.params.tensors()]
    theirs += [*on_torch.optimizer.exp_avg, *on_torch.optimizer.exp_avg_sq]
    for mine, expected in zip(ours, theirs):
        np.testing.assert_allclose(
            mine.cpu().numpy(), expected.numpy(), rtol=1e-10, atol=1e-12 * float(expected.abs().max())
        )
    assert on_kernels.optimizer.steps == on_torch.optimizer.steps == 3
    assert torch.equal(on_kernels.mixture.means.cpu()[fixed.means], state.means[fixed.means])
    assert torch.equal(on_kernels.mixture.covariances.cpu()[fixed.covariances], state.covariances[fixed.covariances])
    assert not torch.equal(on_kernels.mixture.covariances.cpu(), state.covariances)  # the step moved something


def test_several_fits_sgd_steps_in_one_launch_each_get_their_own_step():
    """F fits' SGD steps in one launch of each kernel (the CUDA engine's ensemble step), each with its own
    parameters, units, sums, Adam step count and learning rate, W and fixed components, equal to each
    fit's step alone: the same arithmetic on the same numbers, so to the bit."""
    k, d = 6, 3  # K not a multiple of the block: a program takes components of two fits
    rng = np.random.default_rng(8)
    cases = [_case(40 + f, k, d, scale) for f, scale in enumerate((1.0, 1e-2, 30.0))]
    settings = [(None, "spread", 0.05), (1e-6, "none", 0.01), (2.0, "component", 0.2)]
    fixes = [FixedParameters.none(k, DEVICE)] + [_random_fixed(rng, k, DEVICE) for _ in range(2)]
    alone, together, stats_of = [], [], []
    for (state, x, S), (w, scaling, lr), fixed in zip(cases, settings, fixes):
        fitters = [_sgd(state.to(DEVICE), w, scaling, fixed, lr) for _ in range(2)]
        for fitter in fitters[1:]:  # the second a step ahead: another step count
            fitter.optimizer.steps = 4
        stats = batch_statistics(x, S, state.to(dtype=torch.float32), backend="fused")
        _kernel_sgd_step(fitters[0], stats)
        alone.append(fitters[0])
        together.append(fitters[1])
        stats_of.append(stats)
    for fitter in together:
        fitter.optimizer.steps = 0
    stacked = lambda parts: torch.stack([t.to(DEVICE) for t in parts])  # noqa: E731
    params = [stacked([f.params.tensors()[i] for f in together]) for i in range(3)]
    moments = [
        tuple(stacked([getattr(f.optimizer, m)[i] for f in together]) for i in range(3))
        for m in ("exp_avg", "exp_avg_sq")
    ]
    mixture = Mixture(*(stacked([f.mixture.tensors()[i] for f in together]) for i in range(3)))
    sgd_triton.sgd_step_in_place(
        tuple(params),
        stacked([f.params.scale for f in together]),
        (moments[0], moments[1]),
        type(stats_of[0])(300, *(stacked([getattr(st, n) for st in stats_of]) for n in ("q", "U", "UU", "P"))),
        torch.tensor([_adam_row(f) for f in together], dtype=torch.float64, device=DEVICE),
        stacked([torch.ones(d, dtype=torch.float64) if f.w is None else f.w for f in together]),
        stacked([torch.tensor(f.w is not None, dtype=torch.int8) for f in together]),
        FixedParameters(
            *(stacked([getattr(f, n) for f in fixes]) for n in ("weights", "means", "covariances", "weight_values"))
        ),
        (
            stacked([f.params.initial.means for f in together]),
            stacked([f.params.initial.covariances for f in together]),
        ),
        mixture,
    )
    for f, fitter in enumerate(alone):
        for ours, theirs in zip([*mixture.tensors(), *params], [*fitter.mixture.tensors(), *fitter.params.tensors()]):
            assert torch.equal(ours[f], theirs)
        for ours, theirs in zip([*moments[0], *moments[1]], [*fitter.optimizer.exp_avg, *fitter.optimizer.exp_avg_sq]):
            assert torch.equal(ours[f], theirs)


_COMPILE_FOR_HOPPER = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from scalable_xd.fit.rules.online_em_triton import BLOCK, _online_em_kernel

dim = int(sys.argv[1])
signature = {name: "*fp64" for name in _online_em_kernel.arg_names}
signature.update(q_ptr="*fp32", U_ptr="*fp32", UU_ptr="*fp32", P_ptr="*fp32", fixed_means_ptr="*i1",
                 fixed_cov_ptr="*i1", suspect_ptr="*i8", n_comp="i32", n_all="i32", D="constexpr", DP="constexpr",
                 BLOCK="constexpr")
constexprs = {"D": dim, "DP": triton.next_power_of_2(dim), "BLOCK": BLOCK}
source = triton.compiler.ASTSource(fn=_online_em_kernel, signature=signature, constexprs=constexprs)
assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
"""


_COMPILE_SGD_FOR_HOPPER = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from scalable_xd.fit.rules.sgd_triton import BLOCK, _sgd_components, _sgd_weights

dim = int(sys.argv[1])
target = GPUTarget("cuda", 90, 32)
signature = {name: "*fp64" for name in _sgd_weights.arg_names}
signature.update(q_ptr="*fp32", n_comp="i32", KP="constexpr")
source = triton.compiler.ASTSource(fn=_sgd_weights, signature=signature, constexprs={"KP": 512})
assert triton.compile(source, target=target).asm["cubin"]
signature = {name: "*fp64" for name in _sgd_components.arg_names}
signature.update(U_ptr="*fp32", UU_ptr="*fp32", P_ptr="*fp32", penalised_ptr="*i8", fixed_means_ptr="*i1",
                 fixed_cov_ptr="*i1", n_comp="i32", n_all="i32", D="constexpr", DP="constexpr", BLOCK="constexpr")
constexprs = {"D": dim, "DP": triton.next_power_of_2(dim), "BLOCK": BLOCK}
source = triton.compiler.ASTSource(fn=_sgd_components, signature=signature, constexprs=constexprs)
assert triton.compile(source, target=target).asm["cubin"]
"""


@pytest.mark.parametrize("program", ["online_em", "sgd"])
@pytest.mark.parametrize("d", [1, 7])
def test_the_kernels_compile_for_a_hopper_gpu(program, d, tmp_path):
    """The interpreter accepts code Triton's compiler refuses: compile for sm_90 too (no GPU needed)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path))
    code = {"online_em": _COMPILE_FOR_HOPPER, "sgd": _COMPILE_SGD_FOR_HOPPER}[program]
    done = subprocess.run([sys.executable, "-c", code, str(d)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]

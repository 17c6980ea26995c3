"""Subnormals flushed inside the compiled pass alone (``kernel.float_env``), and the pass still right where
a fit's collapsed components would make them."""

import numba
import numpy as np
import pytest
import torch
from helpers import max_row_relative_error, random_spd

from scalable_xd.kernel import float_env
from scalable_xd.kernel.dispatch import batch_statistics, log_densities
from scalable_xd.mixture import Mixture

TINY32 = float(np.finfo(np.float32).tiny)

on_x86 = pytest.mark.skipif(float_env.MACHINE not in float_env.X86, reason="MXCSR's bits: x86-64's register")


@pytest.mark.parametrize(
    "machine, triple, wants",
    [
        ("x86_64", "x86_64-unknown-linux-gnu", ["stmxcsr", "orl\t$32832", "ldmxcsr", "ldmxcsr"]),
        ("aarch64", "aarch64-unknown-linux-gnu", ["mrs\tx0, FPCR", "#0x1000000", "msr\tFPCR", "msr\tFPCR"]),
        ("arm64", "arm64-apple-macosx", ["mrs\tx0, FPCR", "#0x1000000", "msr\tFPCR", "msr\tFPCR"]),
    ],
)
def test_the_flush_code_sets_and_restores_each_machines_register(machine, triple, wants):
    """The flush and the restore compiled for each machine's target (whichever this one is): x86-64's MXCSR
    gets its FTZ and DAZ bits (0x8040 = 32832), AArch64's FPCR its FZ bit (1 << 24), and each is then put
    back from the value read first."""
    import llvmlite.binding as llvm
    from llvmlite import ir

    module = ir.Module(name="flush")
    module.triple = triple
    function = ir.Function(module, ir.FunctionType(ir.IntType(32), []), "flush_and_restore")
    builder = ir.IRBuilder(function.append_basic_block())
    old = float_env.flush_code(builder, machine)
    float_env.restore_code(builder, old, machine)
    builder.ret(old)
    llvm.initialize_all_targets()  # numba initialises this machine's target alone
    llvm.initialize_all_asmprinters()
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    assembly = llvm.Target.from_triple(triple).create_target_machine().emit_assembly(parsed)
    at = 0
    for want in wants:  # in this order
        at = assembly.index(want, at) + len(want)


def test_elsewhere_the_flush_is_no_code():
    from llvmlite import ir

    function = ir.Function(ir.Module(name="none"), ir.FunctionType(ir.IntType(32), []), "f")
    builder = ir.IRBuilder(function.append_basic_block())
    assert float_env.flush_code(builder, "riscv64").constant == 0
    float_env.restore_code(builder, ir.Constant(ir.IntType(32), 0), "riscv64")
    assert not builder.block.instructions


@numba.njit
def _flushed_products(a, b, out):
    """out = a * b in float32 with the flush bits set, and the register as it was before."""
    before = float_env.flush_subnormals()
    for i in range(out.shape[0]):
        out[i] = a[i] * b[i]
    float_env.restore_float_env(before)
    return before


@numba.njit(parallel=True)
def _pool_registers(n):
    """The register of whichever of numba's threads runs each of n iterations."""
    out = np.empty(n, np.uint32)
    for i in numba.prange(n):
        out[i] = float_env.flush_subnormals()
        float_env.restore_float_env(out[i])
    return out


CONTROL = 0xFFC0  # MXCSR's control bits; bits 0-5 are exception flags that any arithmetic sets and leaves


def _registers() -> set[int]:
    """The control bits of the registers of this thread and of numba's pool."""
    one = np.ones(1, np.float32)
    return {int(r) & CONTROL for r in (_flushed_products(one, one, one.copy()), *_pool_registers(64))}


@on_x86
def test_a_subnormal_product_is_zero_between_flush_and_restore_and_subnormal_after():
    a, b = np.full(4, 1e-30, np.float32), np.full(4, 1e-10, np.float32)
    out = np.empty(4, np.float32)
    before = _flushed_products(a, b, out)
    assert (out == 0.0).all()
    assert before & float_env.FLUSH_BITS == 0
    assert 0.0 < (a * b)[0] < TINY32  # numpy, on this thread: 1e-40, a subnormal, as the register was


def _collapsed_problem(rng, n=4000, k=8, d=7):
    """Points with diagonal noise and a mixture half of whose components have collapsed as a dying
    component of online EM does: weights of 1e-12 to 1e-30 and covariances of 1e-20 to 1e-40, whose
    factorisation beside the noise yields float32 subnormals at every point; 32,000 pairs, which the pass
    shares among threads (``fused.PARALLEL_PAIRS``)."""
    x = rng.normal(scale=3.0, size=(n, d))
    S = np.zeros((n, d, d))
    S[:, np.arange(d), np.arange(d)] = rng.uniform(0.05, 0.5, size=(n, d)) ** 2
    weights = np.concatenate([np.full(k // 2, 1.0 / (k // 2)), np.geomspace(1e-12, 1e-30, k - k // 2)])
    means = rng.normal(scale=3.0, size=(k, d))
    sizes = np.concatenate([np.ones(k // 2), np.geomspace(1e-20, 1e-40, k - k // 2)])
    covs = random_spd(rng, k, d) * sizes[:, None, None]
    return x, S, Mixture(*(torch.tensor(v) for v in (weights, means, covs)))


@on_x86
@pytest.mark.parametrize("threads", [1, 2])
def test_the_pass_over_collapsed_components_matches_float64_and_leaves_the_register_as_it_was(threads):
    """float32 against the float64 pass: the collapsed components' products flushed to 0 lie below float32's
    rounding of the sums they join (1e-4 relative, the tolerance of every float32 comparison here)."""
    x, S, mixture = _collapsed_problem(np.random.default_rng(7))
    before, previous = _registers(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = batch_statistics(torch.tensor(x), torch.tensor(S), mixture, backend="fused")
        single = (torch.tensor(x, dtype=torch.float32), torch.tensor(S, dtype=torch.float32))
        got = batch_statistics(*single, mixture.to(dtype=torch.float32), backend="fused")
        loglik, _ = log_densities(*single, mixture.to(dtype=torch.float32), backend="fused")
    finally:
        torch.set_num_threads(previous)
    live = slice(0, 4)  # the collapsed components' sums are ~1e-12 of the live ones': compared on their own
    for name in ("q", "U", "UU", "P"):
        assert max_row_relative_error(getattr(got, name)[live].double(), getattr(want, name)[live]) < 1e-4, name
    assert torch.isfinite(got.P).all() and torch.isfinite(got.UU).all()
    reference, _ = log_densities(torch.tensor(x), torch.tensor(S), mixture, backend="fused")
    np.testing.assert_allclose(loglik.double().numpy(), reference.numpy(), rtol=1e-5)
    assert _registers() == before
    assert all(register & float_env.FLUSH_BITS == 0 for register in before)

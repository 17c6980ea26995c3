"""Subnormal numbers flushed to zero inside the compiled pass, for numba (x86-64 and AArch64).

Arithmetic that reads or yields a subnormal float (below 1.2e-38 in float32) takes a slow path on x86's vector
units. A fit meets them once a component collapses: a component whose weight dies away in online EM shrinks
its covariance to 1e-17 and below, and the factorisation of V + S in float32 then yields subnormal products
for every point. In a one-epoch fit of the sweep's data, half the components had collapsed by the epoch's
end, and the pass on the last step's mixture was a sixth slower than on the first step's; with subnormals
flushed, the same on both (docs/performance.md).

``flush_subnormals()`` sets the calling thread's MXCSR flush-to-zero and denormals-are-zero bits and returns
the register's old value, which ``restore_float_env(old)`` puts back: each block of the float32 pass sets them
after its allocations and restores them at its end (float64 does not: ``fused_source._source``), so no other code on
the thread (numpy's, the caller's) runs with them. This is what compilers' fast-math start-up code does for a
whole program (gcc links crtfastmath.o); here it holds for the kernel alone, whose fast-math flags already let
LLVM round differently. A value that would have been subnormal becomes 0, as the kernel's exp already gives 0
below e^-700 (``fused_source.EXP_CUTOFF``): it changes a sum only where every term of it is within float32's rounding
(~1e-7) of the subnormal range itself. On AArch64 (Linux's aarch64, Apple's arm64) the same is FPCR's
flush-to-zero bit, FZ, which flushes inputs and results alike; the tests compile both forms for their targets
(``tests/kernel/test_float_env.py``). Elsewhere both are no-ops, and subnormals keep their slow path.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

FLUSH_BITS = 0x8040  # MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6)
FZ_BIT = 1 << 24  # AArch64's FPCR.FZ: subnormal inputs and results of float arithmetic flushed to zero
MACHINE = platform.machine().lower()
X86, ARM = ("x86_64", "amd64"), ("aarch64", "arm64")


def _mxcsr(builder, name: str, slot) -> None:
    """A call of LLVM's ``llvm.x86.sse.<name>`` (stmxcsr or ldmxcsr) on the 32-bit ``slot``."""
    byte = ir.IntType(8).as_pointer()
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [byte]), f"llvm.x86.sse.{name}"
    )
    builder.call(function, [builder.bitcast(slot, byte)])


def _fpcr(builder, value=None):
    """A call of LLVM's ``llvm.aarch64.get.fpcr`` (``value`` None: its 64-bit result) or ``set.fpcr``."""
    i64 = ir.IntType(64)
    if value is None:
        return builder.call(
            cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, []), "llvm.aarch64.get.fpcr"), []
        )
    setter = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i64]), "llvm.aarch64.set.fpcr"
    )
    return builder.call(setter, [value])


def flush_code(builder, machine: str = MACHINE):
    """IR that sets the thread's flush bits on ``machine``, giving the register's old value as i32 (FPCR's
    defined bits all lie in its low 32) or 0 where the machine has no such bits here."""
    i32 = ir.IntType(32)
    if machine in X86:
        slot = cgutils.alloca_once(builder, i32)
        _mxcsr(builder, "stmxcsr", slot)
        old = builder.load(slot)
        builder.store(builder.or_(old, ir.Constant(i32, FLUSH_BITS)), slot)
        _mxcsr(builder, "ldmxcsr", slot)
        return old
    if machine in ARM:
        old = _fpcr(builder)
        _fpcr(builder, builder.or_(old, ir.Constant(old.type, FZ_BIT)))
        return builder.trunc(old, i32)
    return ir.Constant(i32, 0)


def restore_code(builder, old, machine: str = MACHINE) -> None:
    """IR that sets the thread's register back to ``old`` (``flush_code``'s value) on ``machine``."""
    if machine in X86:
        slot = cgutils.alloca_once(builder, ir.IntType(32))
        builder.store(old, slot)
        _mxcsr(builder, "ldmxcsr", slot)
    elif machine in ARM:
        _fpcr(builder, builder.zext(old, ir.IntType(64)))


@intrinsic
def flush_subnormals(typingctx):
    """The thread's float control register as it was (0 where there is none here), after setting its flush
    bits (``flush_code``)."""

    def codegen(context, builder, signature, args):
        return flush_code(builder)

    return types.uint32(), codegen


@intrinsic
def restore_float_env(typingctx, old):
    """The thread's float control register set back to ``old`` (``flush_subnormals``' result)."""

    def codegen(context, builder, signature, args):
        restore_code(builder, args[0])
        return context.get_dummy_value()

    return types.none(old), codegen

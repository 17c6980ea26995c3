"""How the compiled CPU pass reads a batch's rows where they lie in memory (``fused``), for numba.

A shuffled minibatch is 500 rows from anywhere in the data set. Gathered into a batch first, they cost a
step a tenth of the pass itself in waiting for memory at K = 64 (docs/performance.md). Read in place, each
point's row is fetched while the point before it is computed (``prefetch_row``), and the wait is hidden
behind the arithmetic.

``noise_entry`` reads S_ij of a row of dense (N, d, d) noise, diagonal (N, d) variances or compact noise
(standard deviations and correlations), so that one kernel source serves every form (numba compiles one
specialisation per form and dtype).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload, register_jitable

CACHE_LINE = 64  # bytes: what one prefetch brings in


@intrinsic
def _prefetch(typingctx, array, row, offset):
    """A hint (LLVM's prefetch, for reading, kept in every cache level) that the byte ``offset`` of row
    ``row`` of ``array`` (any strides) will be read soon; it never faults, so no bounds to check."""

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        data = context.make_array(array_type)(context, builder, args[0])
        zero = ir.Constant(ir.IntType(64), 0)
        first = [context.cast(builder, args[1], signature.args[1], types.intp)] + [zero] * (array_type.ndim - 1)
        pointer = cgutils.get_item_pointer(context, builder, array_type, data, first, wraparound=False)
        byte = ir.IntType(8).as_pointer()
        shift = context.cast(builder, args[2], signature.args[2], types.intp)
        address = builder.gep(builder.bitcast(pointer, byte), [shift])
        i32 = ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(prefetch, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.none(array, row, offset), codegen


def prefetch_row(noise, row):
    """Ask for every cache line of row ``row`` of an array, or of each array of compact noise's (sigma,
    corr, where) (compiled code only)."""


@overload(prefetch_row)
def _prefetch_row(noise, row):
    if isinstance(noise, types.BaseTuple):  # compact noise: sigma's row and corr's

        def compact(noise, row):
            _prefetch_lines(noise[0], row)
            _prefetch_lines(noise[1], row)

        return compact
    return lambda noise, row: _prefetch_lines(noise, row)


@register_jitable
def _prefetch_lines(array, row):
    """Every line of the ``strides[0]`` bytes from the row's start, its last byte's line included."""
    for offset in range(0, array.strides[0], CACHE_LINE):
        _prefetch(array, row, offset)
    _prefetch(array, row, array.strides[0] - 1)


def noise_entry(noise, row, i, j, real):
    """S_ij (i >= j) of point ``row`` in the pass's float type ``real`` (np.float32 or np.float64), from
    ``noise``: (N, d, d) covariances, (N, d) variances, or compact noise (sigma (N, d), corr (N, P), where
    (d, d): the column of corr holding (i, j)'s correlation, -1 for none). Each number is cast to ``real``
    as it is read and the products are taken in ``real``, as ``data.noise`` builds S in the pass's dtype,
    so that the kernel sees the same S either way (compiled code only)."""


@overload(noise_entry)
def _noise_entry(noise, row, i, j, real):
    if isinstance(noise, types.BaseTuple):

        def compact(noise, row, i, j, real):
            sigma, corr, where = noise
            if i == j:
                return real(sigma[row, i]) * real(sigma[row, i])
            p = where[i, j]
            return real(corr[row, p]) * (real(sigma[row, i]) * real(sigma[row, j])) if p >= 0 else real(0.0)

        return compact
    if noise.ndim == 3:
        return lambda noise, row, i, j, real: real(noise[row, i, j])
    return lambda noise, row, i, j, real: real(noise[row, i]) if i == j else real(0.0)

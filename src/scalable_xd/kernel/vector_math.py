"""exp and log in float64 as straight-line source for the generated kernels, so that LLVM vectorises the
loops that call them.

numba compiles ``math.exp`` and ``math.log`` to calls into the C library, one element at a time, and a loop
with such a call is not vectorised: in the fused pass at K = 512 these calls took a quarter of the time.
The functions here are the classic reductions (Cody & Waite 1980; the log of Sun's fdlibm, 1993): exp(x) =
2^n exp(r) with |r| <= ln 2 / 2 and a degree-13 Taylor polynomial, log(x) = e ln 2 + log(m) with m in
[sqrt(2) / 2, sqrt(2)) and fdlibm's minimax polynomial in s = (m - 1) / (m + 1); both within a few units
in the last place. The exponent is moved in and out of a float by integer operations on its bits, through
an int64 array and its float64 view (``bits``, ``bits_f``, one entry per lane), and converted to and from
floats by adding 2^52 ("magic number" conversions), so that no float-integer conversion instruction is
needed on any x86 vector unit (only through memory: with fast math, (a + 2^52) - 2^52 folds to a).

They are compiled as functions of their own, without fast math's reassociation (which would merge Cody and
Waite's two-part reduction into one, losing 200 ulps at x = -700), and LLVM inlines them into the
kernel's loops with those flags kept per instruction.
"""

from __future__ import annotations

import os
from math import factorial

LOG2E = 1.4426950408889634
LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that n * LN2_HI is exact for |n| < 2^11
LN2_LO = 1.90821492927058770002e-10
SQRT2 = 1.4142135623730951
TWO52 = 4503599627370496.0  # 2^52: x + 2^52 holds the integer x in its low mantissa bits, for 0 <= x < 2^52
SHIFTER = 6755399441055744.0  # 1.5 * 2^52: the same for -2^51 <= x < 2^51, by rounding to nearest
SHIFTER_BITS = 0x4338000000000000  # its bits
MANTISSA = 0x000FFFFFFFFFFFFF
ONE_BITS = 0x3FF0000000000000  # the bits of 1.0
TWO52_BITS = 0x4330000000000000
LOG_COEFFICIENTS = (  # fdlibm's Lg1..Lg7
    6.666666666666735130e-01,
    3.999999999940941908e-01,
    2.857142874366239149e-01,
    2.222219843214978396e-01,
    1.818357216161805012e-01,
    1.531383769920937332e-01,
    1.479819860511658591e-01,
)
EXP_DEGREE = 13  # |r|^14 / 14! < 4e-18 for |r| <= ln 2 / 2


def _horner(var: str, coefficients: list[float]) -> str:
    expr = repr(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        expr = f"{c!r} + {var} * ({expr})"
    return expr


# With SCALABLE_XD_NO_FAST_MATH=1, the kernels are compiled without fast math's contraction and reassociation
# (and these functions with nsz alone), so that every build of a kernel rounds each operation as written
# (fused_source.FASTMATH says why a build can differ).
NO_FAST_MATH = os.environ.get("SCALABLE_XD_NO_FAST_MATH", "0") not in ("", "0")
# not reassoc (see above), not nnan / ninf (inf and NaN pass)
FASTMATH = {"nsz"} if NO_FAST_MATH else {"nsz", "arcp", "contract", "afn"}


def _exp_lines(x: str, out: str, lane: str, floor: float) -> list[str]:
    """Statements setting ``out`` to exp(``x``) for ``x`` <= 0, and to 0 where ``x`` <= ``floor`` (a number
    above -708, below which 2^n is no longer a normal float)."""
    return [
        f"ex_x = max({x}, {floor!r})",
        f"ex_n = math.floor(ex_x * {LOG2E!r} + 0.5)",  # a whole number: its float + 1.5 * 2^52 holds it
        f"bits_f[{lane}] = ex_n + {SHIFTER!r}",  # in the low bits (read back from memory, so that fast
        # math's reassociation cannot cancel the two shifts)
        f"ex_r = (ex_x - ex_n * {LN2_HI!r}) - ex_n * {LN2_LO!r}",
        f"ex_p = {_horner('ex_r', [1.0 / factorial(i) for i in range(EXP_DEGREE + 1)])}",
        f"bits[{lane}] = (bits[{lane}] - {SHIFTER_BITS} + 1023) << 52",  # 2^n
        f"{out} = ex_p * bits_f[{lane}] if {x} > {floor!r} else 0.0",
    ]


def _log_lines(x: str, out: str, lane: str) -> list[str]:
    """Statements setting ``out`` to log(``x``) for a float64 ``x`` > 0 (subnormals included; 0 gives -inf
    and inf gives inf, as math.log)."""
    lg = LOG_COEFFICIENTS
    return [
        f"lg_tiny = {x} < 2.2250738585072014e-308",  # subnormal: scaled by 2^54 first
        f"bits_f[{lane}] = {x} * 18014398509481984.0 if lg_tiny else {x}",
        f"lg_b = bits[{lane}]",
        f"bits[{lane}] = (lg_b >> 52) | {TWO52_BITS}",  # the biased exponent as a float, exactly
        f"lg_e = bits_f[{lane}] - {TWO52 + 1023.0!r} - (54.0 if lg_tiny else 0.0)",
        f"bits[{lane}] = (lg_b & {MANTISSA}) | {ONE_BITS}",
        f"lg_m = bits_f[{lane}]",  # in [1, 2)
        f"lg_big = lg_m > {SQRT2!r}",
        "lg_m = lg_m * 0.5 if lg_big else lg_m",
        "lg_e = lg_e + 1.0 if lg_big else lg_e",
        "lg_f = lg_m - 1.0",
        "lg_s = lg_f / (2.0 + lg_f)",
        "lg_z = lg_s * lg_s",
        "lg_w = lg_z * lg_z",
        f"lg_r = lg_z * ({lg[0]!r} + lg_w * ({lg[2]!r} + lg_w * ({lg[4]!r} + lg_w * {lg[6]!r})))"
        f" + lg_w * ({lg[1]!r} + lg_w * ({lg[3]!r} + lg_w * {lg[5]!r}))",
        "lg_h = 0.5 * lg_f * lg_f",
        f"{out} = lg_e * {LN2_HI!r} - ((lg_h - (lg_s * (lg_h + lg_r) + lg_e * {LN2_LO!r})) - lg_f)",
        f"{out} = {out} if {x} > 0.0 and {x} < math.inf else (math.inf if {x} > 0.0 else "
        f"(-math.inf if {x} == 0.0 else math.nan))",
    ]


def helpers_source(floor: float) -> str:
    """Source of ``exp_lane(x, bits, bits_f, lane)`` (exp, 0 at or below ``floor``) and ``log_lane(...)``,
    for a module that imports math, numpy as np and numba's njit; ``lane`` is the index of the entry of
    ``bits`` and of its float64 view ``bits_f`` that the call may overwrite."""
    head = f"@njit(fastmath={{{', '.join(map(repr, sorted(FASTMATH)))}}}, error_model='numpy', cache=True)"
    functions = [("exp_lane", _exp_lines("x", "out", "lane", floor)), ("log_lane", _log_lines("x", "out", "lane"))]
    lines = []
    for name, body in functions:
        lines += ["", "", head, f"def {name}(x, bits, bits_f, lane):", *("    " + s for s in body), "    return out"]
    return "\n".join(lines[2:]) + "\n"

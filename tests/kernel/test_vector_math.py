"""The kernels' vectorisable exp and log (kernel/vector_math.py) against numpy's, called from a loop
compiled with the kernel's fast-math flags, as the fused pass calls them."""

import numpy as np
import pytest

from scalable_xd.kernel.fused_source import EXP_CUTOFF, FASTMATH
from scalable_xd.kernel.vector_math import helpers_source

pytest.importorskip("numba")


@pytest.fixture(scope="module")
def lanes():
    """(exp over an array, log over an array), each a loop like the kernel's."""
    loops = [
        f"@njit(fastmath={FASTMATH!r}, error_model='numpy')",
        "def over(fn, x):",
        "    out, bits = np.empty_like(x), np.empty(x.shape[0], np.int64)",
        "    bits_f = bits.view(np.float64)",
        "    for i in range(x.shape[0]):",
        "        out[i] = fn(x[i], bits, bits_f, i)",
        "    return out",
    ]
    source = "import math\nimport numpy as np\nfrom numba import njit\n\n" + helpers_source(EXP_CUTOFF)
    source = source.replace("cache=True", "cache=False") + "\n\n" + "\n".join(loops) + "\n"
    namespace = {}
    exec(compile(source, "vector_math_test", "exec"), namespace)
    over, exp_lane, log_lane = namespace["over"], namespace["exp_lane"], namespace["log_lane"]
    return (lambda x: over(exp_lane, x)), (lambda x: over(log_lane, x))


def _ulps(got, want):
    return np.abs(got - want) / np.spacing(np.abs(want))


def test_exp_is_within_two_ulps_down_to_the_cutoff_and_zero_below(lanes):
    exp, _ = lanes
    rng = np.random.default_rng(0)
    # -700 is where a single-step reduction x - n ln2 would lose 200 ulps (fast math's reassociation)
    x = np.concatenate([-rng.random(100_000) * -EXP_CUTOFF, -rng.random(1000) * 1e-6, [0.0, -0.0, -699.999]])
    assert _ulps(exp(x), np.exp(x)).max() <= 2
    below = np.array([EXP_CUTOFF, EXP_CUTOFF - 1e-9, -745.0, -1e300, -np.inf, np.nan])
    np.testing.assert_array_equal(exp(below), 0.0)


def test_log_is_within_two_ulps_over_every_positive_float_and_takes_log_s_special_values(lanes):
    _, log = lanes
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [
            np.exp(rng.uniform(-709, 709, 100_000)),
            rng.uniform(0.5, 2.0, 10_000),  # around 1, where log is near 0 and its relative error the hardest
            [np.sqrt(2.0), np.nextafter(np.sqrt(2.0), 2), 1.0, np.finfo(np.float64).max],
            [5e-324, 1e-310, np.finfo(np.float64).tiny, np.nextafter(np.finfo(np.float64).tiny, 0)],  # subnormal
        ]
    )
    assert _ulps(log(x), np.log(x)).max() <= 2
    with np.errstate(divide="ignore", invalid="ignore"):
        special = np.array([0.0, np.inf, -1.0, -np.inf, np.nan])
        np.testing.assert_array_equal(log(special), np.log(special))

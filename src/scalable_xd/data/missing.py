"""The missing-entry convention of the noise model (the paper's): an entry whose value is 0 and whose noise
variance is ``MISSING_VARIANCE`` is missing, and, scored as measured, adds ``MISSING_LOGLIK_CONSTANT``
(log N(0 | 0, 1e12), less the model's small V_jj) to a star's log-likelihood. Numbers only, so that the
pipeline's light modules read them without loading torch."""

from __future__ import annotations

import math

MISSING_VARIANCE = 1e12
MISSING_LOGLIK_CONSTANT = -0.5 * math.log(2 * math.pi * MISSING_VARIANCE)

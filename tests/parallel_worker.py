"""One process of a data-parallel fit, started by tests/fit/test_parallel.py (as torchrun would start it: RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment). Usage:

    python tests/parallel_worker.py OUTPUT.npz JSON_SETTINGS [CHECKPOINT] [DIE_AFTER_BATCHES]

RANK1_DATA="fewer rows", "other values" or "nan" in the environment gives rank 1 other data than rank 0
(the last with NaN at row 5, column 1);
RANK1_SETTINGS (JSON) replaces settings on rank 1 only; RANK1_CHECKPOINT gives rank 1 another checkpoint
path; RANK0_VAL=1 gives rank 0 alone validation data, RANK0_EVAL=1 eval_sets; NOISE_MIXTURE=1 fits the noise
as a mixture (``as_noise_mixture``); SELECTION=LIMIT fits under the selection x_0 < LIMIT (and
every rank writes its model, rank r > 0 beside OUTPUT as rank{r}.npz).
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch.distributed as dist

import scalable_xd.fit.engines.reference
from scalable_xd import XDGMM, NoiseMixture
from scalable_xd.fit.selection import Selection


def problem():
    """The data every process (and the one-process reference) fits: three noisy clusters in 3-D."""
    rng = np.random.default_rng(7)
    means = np.array([[0.0, 0.0, 0.0], [4.0, 0.0, 1.0], [0.0, 5.0, -2.0]])
    x = np.concatenate([rng.normal(size=(700, 3)) + m for m in means])
    S = np.stack([np.diag(rng.uniform(0.05, 0.3, 3)) for _ in range(len(x))])
    return rng.permutation(x), S  # the noise is drawn independently per row, so it needs no permuting


def as_noise_mixture(S):
    """Each point's Gaussian noise S_i as a skewed mixture of two: weights 3/4 and 1/4, offsets -1/4 and 3/4
    of each standard deviation, covariances S_i / 2 (what NOISE_MIXTURE=1 fits)."""
    sd = np.sqrt(np.diagonal(S, axis1=1, axis2=2))
    offsets = np.stack([-0.25 * sd, 0.75 * sd], axis=1)
    return NoiseMixture(np.broadcast_to([0.75, 0.25], (len(S), 2)), np.stack([S / 2, S / 2], axis=1), offsets)


def main(output, settings, checkpoint=None, die_after=None):
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if die_after is not None and dist.get_rank() == 1:
        calls = {"n": 0}
        real = scalable_xd.fit.engines.reference.batch_statistics

        def dying(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > int(die_after):
                os._exit(3)  # a killed process: no clean shutdown
            return real(*args, **kwargs)

        scalable_xd.fit.engines.reference.batch_statistics = dying
    x, S = problem()
    if dist.get_rank() == 1 and os.environ.get("RANK1_DATA") == "fewer rows":
        x, S = x[:-100], S[:-100]
    if dist.get_rank() == 1 and os.environ.get("RANK1_DATA") == "other values":
        x = x + 0.5
    if dist.get_rank() == 1 and os.environ.get("RANK1_DATA") == "nan":
        x = x.copy()
        x[5, 1] = np.nan
    settings = json.loads(settings)
    if dist.get_rank() == 1:
        settings.update(json.loads(os.environ.get("RANK1_SETTINGS", "{}")))
    extra = dict(X_val=x[:100], Xcov_val=S[:100]) if dist.get_rank() == 0 and os.environ.get("RANK0_VAL") else {}
    if dist.get_rank() == 0 and os.environ.get("RANK0_EVAL"):
        extra["eval_sets"] = {"held": (x[:100], S[:100])}
    if dist.get_rank() == 1 and os.environ.get("RANK1_CHECKPOINT"):
        checkpoint = os.environ["RANK1_CHECKPOINT"]
    if os.environ.get("SELECTION"):
        limit = float(os.environ["SELECTION"])
        keep = x[:, 0] < limit
        x, S = x[keep], S[keep]
        extra["selection"] = Selection(lambda v: (v[:, 0] < limit).astype(float))
    noise = as_noise_mixture(S) if os.environ.get("NOISE_MIXTURE") else S
    model = XDGMM(**settings).fit(x, Xcov=noise, checkpoint=checkpoint or None, **extra)
    rank = dist.get_rank()
    if rank == 0 or os.environ.get("SELECTION"):
        np.savez(
            output if rank == 0 else Path(output).with_name(f"rank{rank}.npz"),
            weights=model.weights_,
            means=model.means_,
            covariances=model.covariances_,
            history=json.dumps(model.history_),
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

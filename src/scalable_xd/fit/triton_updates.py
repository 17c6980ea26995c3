"""Online EM's update as one Triton kernel, for the minibatch step a GPU replays (``cuda_graphs``).

Written as torch calls, online EM's float64 update (``updates.online_em_update``, then ``regularised``) is
about a hundred small kernels (products, sums, scatters and copies of K 7 x 7 matrices); replayed from a
CUDA graph each still costs the GPU a few microseconds, and together they were two thirds of a step at the
paper's batch of 500 (``profile_batch_cuda_K512_b500.json``: 107 kernels a step). Here a lane takes one
component and does its whole update in registers, as ``fused_updates`` does for the CPU, operation for
operation, so the results agree with the torch update to rounding: it reads the running state and the
batch's sums and writes, in place, the new running state and the mixture the next E-step uses, and flags
the components whose new covariance rounding left without a Cholesky factor (for ``deferred_checks``).

The source is generated per D, as the statistics kernels' is (``kernel.triton_pass``), and runs on the
CPU through Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check it.
"""

from __future__ import annotations

from functools import cache

import torch

from ..kernel.statistics import Statistics
from ..kernel.unrolled_source import import_generated
from ..mixture import Mixture

BLOCK = 32  # components per program: one per thread of a one-warp program


def _source(dim: int) -> str:
    """The update kernel for dimension ``dim``: ``fused_updates._online_em_components`` unrolled."""
    D, r = dim, range(dim)
    body = [
        "k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
        "on = k < n_comp",
        "step = tl.load(step_ptr)",
        "n = tl.load(n_ptr).to(tl.float64)",
        "data_size = tl.load(const_ptr)",  # 0: the paper's W added (or no W)
        "tiny = tl.load(const_ptr + 1)",
        "fixed_mean = tl.load(fixed_means_ptr + k, mask=on, other=0) != 0",
        "fixed_cov = tl.load(fixed_cov_ptr + k, mask=on, other=0) != 0",
        "free = tl.where(fixed_cov, 0.0, 1.0)",
        "paper = tl.full([BLOCK], 0.0, tl.float64) + data_size == 0.0",  # as a block, to combine with blocks
        "plain = paper | fixed_cov",
        "weight = tl.load(weights_ptr + k, mask=on, other=1.0)",
        "count = weight * data_size",
    ]
    for i in r:
        body.append(f"w{i} = tl.load(w_ptr + {i})")
        body.append(f"m{i} = tl.load(means_ptr + k * {D} + {i}, mask=on, other=0.0)")
        body.append(f"U{i} = tl.load(U_ptr + k * {D} + {i}, mask=on, other=0.0).to(tl.float64)")
        for j in r:
            at = f"k * {D * D} + {i * D + j}"
            body.append(f"c{i}_{j} = tl.load(cov_ptr + {at}, mask=on, other={1.0 if i == j else 0.0})")
            body.append(
                f"B{i}_{j} = tl.load(UU_ptr + {at}, mask=on, other=0.0).to(tl.float64)"
                f" - tl.load(P_ptr + {at}, mask=on, other=0.0).to(tl.float64)"
            )
    for i in r:  # V: the covariances the batch's E-step used
        for j in r:
            ridge = f" + w{i}" if i == j else ""
            plain_ridge = f" + free * w{i}" if i == j else ""
            body.append(f"V{i}_{j} = tl.where(plain, c{i}_{j}{plain_ridge}, (count * c{i}_{j}{ridge}) / (count + 1.0))")
    body += [
        "q_b = tl.load(q_ptr + k, mask=on, other=0.0).to(tl.float64) / n",
        "q_new = (1.0 - step) * weight + step * q_b",
        "live = q_new > tiny",
        "q_safe = tl.where(live, q_new, 1.0)",
        "pull = step * q_b / q_safe",
    ]
    body += [f"g{i} = step * U{i} / (n * q_safe)" for i in r]
    for i in r:
        for j in r:
            body.append(f"i{i}_{j} = step * B{i}_{j} / (n * q_safe) - tl.where(fixed_mean, 0.0, g{i} * g{j})")
    for i in r:  # t = V inner
        for j in r:
            body.append(f"t{i}_{j} = " + " + ".join(f"V{i}_{m} * i{m}_{j}" for m in r))
    for i in r:  # a = Vr + shift + t V
        for j in r:
            tv = " + ".join(f"t{i}_{m} * V{m}_{j}" for m in r)
            plain_shift = f"c{i}_{j} + pull * w{i}" if i == j else f"c{i}_{j}"
            body.append(f"a{i}_{j} = tl.where(paper, {plain_shift}, c{i}_{j} + pull * (V{i}_{j} - c{i}_{j})) + ({tv})")
    body += ["move_mean = live & ~fixed_mean", "update_cov = live & ~fixed_cov", "new_count = q_new * data_size"]
    body += [
        "tl.store(weights_ptr + k, q_new, mask=on)",
        "tl.store(e_weights_ptr + k, q_new, mask=on)",
    ]
    for i in r:
        shift = " + ".join(f"V{i}_{m} * g{m}" for m in r)
        body.append(f"nm{i} = tl.where(move_mean, ({shift}) + m{i}, m{i})")
        body.append(f"tl.store(means_ptr + k * {D} + {i}, nm{i}, mask=on)")
        body.append(f"tl.store(e_means_ptr + k * {D} + {i}, nm{i}, mask=on)")
    finite = []
    for i in r:
        for j in r:
            at = f"k * {D * D} + {i * D + j}"
            ridge = f" + w{i}" if i == j else ""
            plain_ridge = f" + free * w{i}" if i == j else ""
            body += [
                f"n{i}_{j} = tl.where(update_cov, 0.5 * (a{i}_{j} + a{j}_{i}), c{i}_{j})",
                f"tl.store(cov_ptr + {at}, n{i}_{j}, mask=on)",
                f"e{i}_{j} = tl.where(plain, n{i}_{j}{plain_ridge}, (new_count * n{i}_{j}{ridge}) / (new_count + 1.0))",
                f"tl.store(e_cov_ptr + {at}, e{i}_{j}, mask=on)",
            ]
            finite.append(f"(n{i}_{j} - n{i}_{j} == 0.0)")  # false for inf and NaN
    # Whether the new covariance has a Cholesky factor (every pivot positive, NaN not), as LAPACK decides
    pivots = []
    for j in r:
        for i in range(j, D):
            terms = " - ".join([f"n{i}_{j}"] + [f"f{i}_{x} * f{j}_{x}" for x in range(j)])
            if i == j:
                body += [f"p{j} = {terms}", f"f{j}_{j} = tl.sqrt(tl.where(p{j} > 0.0, p{j}, 1.0))"]
                pivots.append(f"(p{j} > 0.0)")
            else:
                body.append(f"f{i}_{j} = ({terms}) / f{j}_{j}")
    body.append(f"finite = {' & '.join(finite)}")
    body.append(f"suspect = update_cov & finite & ~({' & '.join(pivots)})")
    body.append("tl.store(suspect_ptr + k, suspect.to(tl.int8), mask=on)")
    arguments = (
        "weights_ptr, means_ptr, cov_ptr, e_weights_ptr, e_means_ptr, e_cov_ptr, q_ptr, U_ptr, UU_ptr, P_ptr, "
        "n_ptr, step_ptr, w_ptr, const_ptr, fixed_means_ptr, fixed_cov_ptr, suspect_ptr, n_comp, BLOCK: tl.constexpr"
    )
    return (
        "\n".join(
            [
                f"# Online EM's update for D = {dim}, written by scalable_xd.fit.triton_updates.",
                "import triton",
                "import triton.language as tl",
                "",
                "",
                "@triton.jit",
                f"def online_em({arguments}):",
                *("    " + line for line in body),
            ]
        )
        + "\n"
    )


@cache
def kernel(dim: int):
    """The update kernel for dimension ``dim``, from its generated module (Triton reads a kernel's source
    from its file)."""
    return import_generated(f"triton_online_em_d{dim}", _source(dim)).online_em


def online_em_step_in_place(
    state: Mixture,
    e_step: Mixture,
    stats: Statistics,
    step: torch.Tensor,
    w: torch.Tensor | None,
    fixed,
    constants: torch.Tensor,
) -> torch.Tensor:
    """``updates.online_em_update`` then ``updates.regularised``, written into ``state``'s and ``e_step``'s
    tensors (float64, contiguous), for a ``step`` on the device. ``fixed``: a ``FixedParameters``; where
    any parameter is fixed, the caller shares the E-step's weights afterwards, as ``regularised`` does.
    ``constants``: (data_size, or 0 for the paper's W added, and float64's smallest normal number) on the
    device. Returns which components' new covariance has no Cholesky factor (int8, (K,)), for the caller
    to note or clip."""
    k, dim = state.means.shape
    n = stats.n_points
    if not torch.is_tensor(n):
        n = torch.full((), float(n), dtype=torch.float64, device=state.means.device)
    w = torch.zeros(dim, dtype=torch.float64, device=state.means.device) if w is None else w
    suspect = torch.empty(k, dtype=torch.int8, device=state.means.device)
    grid = ((k + BLOCK - 1) // BLOCK,)
    kernel(dim)[grid](
        *state.tensors(),
        *e_step.tensors(),
        *(t.contiguous() for t in (stats.q, stats.U, stats.UU, stats.P)),
        n,
        step,
        w,
        constants,
        fixed.means,
        fixed.covariances,
        suspect,
        k,
        BLOCK=BLOCK,
        num_warps=1,
    )
    return suspect

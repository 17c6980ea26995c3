"""CUDA graphs (``torch.cuda.CUDAGraph``) as the fit's replayed steps and k-means' windows use them: a first
run on a side stream, then a capture that a refusal turns into a warning rather than an error."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("scalable_xd.fit")


def warm_up(device: torch.device, body) -> None:
    """``body()`` eagerly on a side stream, as CUDA graphs ask of a first run before a capture: kernels
    compile, the allocator's pools settle."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        body()
    current.wait_stream(side)


def captured(body, what: str) -> torch.cuda.CUDAGraph | None:
    """``body``'s kernels captured as a CUDA graph (captured, not run), or None where CUDA refuses the
    capture, which a warning naming ``what`` says: the caller then runs its steps uncaptured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            body()
    except RuntimeError as err:
        log.warning("%s could not be captured as a CUDA graph (%s): its steps run uncaptured", what, err)
        return None
    return graph

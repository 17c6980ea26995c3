"""The statistics pass every fitter, the scorer and the posterior stand on: ``dispatch`` picks a backend
(``fused``: numba on the CPU; ``triton_pass``: Triton on CUDA; ``unrolled``: torch, eager or through
``torch.compile``; ``linalg``: batched LAPACK, for projections) and chunks the pairs; ``statistics``
defines the sums each backend returns; ``unrolled_source`` writes the D x D algebra that the generated
kernels share."""

# The statistics pass's implementations (``dispatch``); projected data take linalg whatever is asked. Here,
# not in ``dispatch``, so that the settings' readers (the command line's help) name them without torch.
BACKENDS = ("auto", "fused", "triton", "compiled", "unrolled", "linalg")


def check_backend(name: str) -> None:
    """A ValueError for a backend name not in ``BACKENDS``, listing them."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")

"""The statistics pass every fitter, the scorer and the posterior stand on: ``dispatch`` picks a backend
(``fused``: numba on the CPU; ``triton_pass``: Triton on CUDA; ``unrolled``: torch, eager or through
``torch.compile``; ``linalg``: batched LAPACK, for projections) and chunks the pairs; ``statistics``
defines the sums each backend returns; ``unrolled_source`` writes the D x D algebra that the generated
kernels share."""

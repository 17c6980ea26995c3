"""The statistics pass every fitter, the scorer and the posterior stand on: ``dispatch`` picks a backend
(``unrolled``, its ``torch.compile`` form, or ``linalg`` for projections) and chunks the pairs;
``statistics`` defines the sums each backend returns."""

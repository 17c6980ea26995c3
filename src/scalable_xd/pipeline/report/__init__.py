"""Tables and figures of the paper, from the metrics and models the fit steps write.

Most figures hold for any survey's features; those that read particular features ask for the roles they
play (``features_file.ROLES``), and the workflow draws a figure only where the survey's spec has its roles
(``figures_for``, written beside the features in ``features.json``)."""

from __future__ import annotations

# The figures that read features by role, with the roles they need: the sky's density needs sky position;
# the denoised colour-magnitude diagram a colour, a magnitude and a parallax.
FIGURE_ROLES = {
    "sky_density": ("ra", "dec"),
    "denoised": ("colour", "magnitude", "parallax"),
}


def figures_for(spec) -> list[str]:
    """The figures of ``FIGURE_ROLES`` that ``spec`` (a ``features_file.FeatureSpec``) has the roles of."""
    return [figure for figure, roles in FIGURE_ROLES.items() if spec.has(*roles)]

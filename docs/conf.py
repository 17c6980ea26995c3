"""Sphinx configuration of the scalable-xd documentation (``sphinx-build -W docs docs/_build/html``).

Sphinx with numpydoc, autodoc/autosummary and MyST Markdown: what NumPy, SciPy, scikit-learn, astropy and
healpy use, so the API pages read like theirs, and the guide's pages stay Markdown, readable on a code
host as well as on the site.
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent / "src"))  # the checkout's package, installed or not

from scalable_xd import __version__  # noqa: E402

project = "scalable-xd"
author = "scalable-xd developers"
copyright = "2026, scalable-xd developers"
release = __version__
version = ".".join(__version__.split(".")[:2])

extensions = [
    "myst_parser",
    "numpydoc",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # MathJax served from _static: the pages' math renders without the network
    "sphinxarg.ext",
]
smartquotes_action = "qe"  # curly quotes and ellipses, but "--" stays two hyphens: options must copy as typed
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # links such as user-guide/scaling.md#data-larger-than-memory-streamed-fits
myst_enable_extensions = ["dollarmath"]
autosummary_generate = False  # one page, written out in reference/api.md
autodoc_typehints = "none"  # numpydoc writes the types from the docstrings
numpydoc_show_class_members = False
numpydoc_validation_checks = set()  # docstrings are checked by reading; the build fails on broken markup
html_theme = "alabaster"
html_static_path = []
html_title = f"scalable-xd {release}"

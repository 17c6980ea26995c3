"""The documentation's Python examples run as written (with small data where a page leaves the data to the
reader), and its pages link only to pages and files that exist."""

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import draw_xd_data, random_spd

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
PAGES = [p for p in PAGES if "_build" not in p.parts]
FENCE = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)


def _examples() -> list:
    """Each page's Python examples, joined in order: a page's later examples use its earlier ones."""
    pages = []
    for page in PAGES:
        blocks = []
        for match in FENCE.finditer(page.read_text()):
            blocks.append("\n".join(line[len(match.group(1)) :] for line in match.group(2).splitlines()))
        if blocks:
            pages.append(pytest.param("\n".join(blocks), id=str(page.relative_to(REPO))))
    return pages


def _namespace(tmp_path) -> dict:
    """What the guide's examples take as given: noisy data X, Xcov (with validation and test splits),
    initial parameters, weights, a mask, and Parquet folders train/, val/, test/ of two features."""
    rng = np.random.default_rng(0)
    k, d = 3, 4
    weights, means, covs = np.ones(k) / k, rng.normal(scale=3, size=(k, d)), random_spd(rng, k, d)
    X, Xcov, _, _ = draw_xd_data(rng, 3000, weights, means, covs, 0.1, 0.5)
    names = {}
    for split, rows in (("", slice(0, 2000)), ("_val", slice(2000, 2500)), ("_test", slice(2500, 3000))):
        names[f"X{split}"], names[f"Xcov{split}"] = X[rows], Xcov[rows]
        folder = tmp_path / (split.strip("_") or "train")
        folder.mkdir()
        frame = pd.DataFrame(
            {
                "x0": X[rows, 0],
                "x1": X[rows, 1],
                "s0": np.sqrt(Xcov[rows, 0, 0]),
                "s1": np.sqrt(Xcov[rows, 1, 1]),
                "rho01": Xcov[rows, 0, 1] / np.sqrt(Xcov[rows, 0, 0] * Xcov[rows, 1, 1]),
            }
        )
        frame.to_parquet(folder / "part-0.parquet")
    mask = np.zeros(8, bool)
    mask[:2] = True
    return {
        "np": np,
        **names,
        "m0": rng.normal(scale=3, size=(8, d)),
        "V0": np.broadcast_to(np.eye(d), (8, d, d)).copy(),
        "mask": mask,
        "w": rng.uniform(0.5, 2.0, len(names["X"])),
    }


@pytest.mark.slow
@pytest.mark.parametrize("code", _examples())
def test_the_pages_examples_run(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "example", "exec"), _namespace(tmp_path))


def test_pages_link_to_what_exists():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), f"{page.relative_to(REPO)} links to {target}"


def test_the_contributing_guide_names_every_module():
    """docs/contributing.md's layout names each of the library's modules, so a module added or moved is
    placed on the map too."""
    layout = (REPO / "docs" / "contributing.md").read_text().split("## Layout", 1)[1].split("## Extending", 1)[0]
    words = set(re.findall(r"[A-Za-z_]+", layout))
    package = REPO / "src" / "scalable_xd"
    modules = {p.stem for p in package.rglob("*.py") if p.stem != "__init__"}
    packages = {p.parent.name for p in package.rglob("__init__.py") if p.parent != package}
    assert not (modules | packages) - words, sorted((modules | packages) - words)

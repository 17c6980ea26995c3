"""The methods table is the one place a method is described, and the package has no import cycle."""

import ast
from pathlib import Path

import numpy as np
import pytest
from helpers import draw_xd_data, random_spd

from scalable_xd import XDGMM
from scalable_xd.fit.families.batch_em import BatchEM
from scalable_xd.fit.methods import METHODS, Method, check_settings, paper_methods
from scalable_xd.pipeline.report.style import SPARE_COLOURS, colour, in_paper_order, method_name
from scalable_xd.settings import FitSettings

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "scalable_xd"


def test_the_paper_methods_are_batch_em_minibatch_em_and_sgd():
    assert paper_methods() == ["em", "minibatch_em", "sgd"]
    assert paper_methods(per_batch=True) == ["minibatch_em", "sgd"]


class OneStepEM(BatchEM):
    """A toy method defined in this test alone: Bovy et al.'s EM under another name."""


def test_a_method_is_one_row_and_one_fitter(monkeypatch):
    """A row added here (and nowhere in the package) is accepted by the settings, checked by their
    cross-checks, run by the estimator as its row says, and shown by the report under its name in a spare
    colour until the report's table gives it a look."""
    build = lambda s, mixture, fixed, data_size, w: OneStepEM(mixture, w=w, fixed=fixed)  # noqa: E731
    row = Method("toy_em", per_batch=False, build=build, uses_tol=True, split_merge=None)
    monkeypatch.setitem(METHODS, "toy_em", row)
    assert check_settings(FitSettings(method="toy_em")).method == "toy_em"
    with pytest.raises(ValueError, match="averages minibatch updates"):
        check_settings(FitSettings(method="toy_em", averaging="polyak"))
    with pytest.raises(ValueError, match="split_merge works with em, minibatch_em, sgd, stochastic_minibatch_em,"):
        check_settings(FitSettings(method="toy_em", split_merge=True))
    with pytest.raises(ValueError, match="choose one of em, .*toy_em"):
        XDGMM(method="no_such_method").fit(np.zeros((10, 2)))

    rng = np.random.default_rng(3)
    k, d = 3, 2
    x, S, _, _ = draw_xd_data(rng, 600, np.ones(k) / k, rng.normal(scale=4, size=(k, d)), random_spd(rng, k, d), 0.2, 1)
    common = dict(n_components=k, epochs=30, dtype="float64", random_state=0, means_init=x[:k], device="cpu")
    toy = XDGMM(method="toy_em", **common).fit(x, Xcov=S)
    em = XDGMM(method="em", acceleration="none", **common).fit(x, Xcov=S)
    assert toy.converged_ and toy.n_iter_ == em.n_iter_  # uses_tol: stopped by tol, as batch EM is
    np.testing.assert_array_equal(toy.means_, em.means_)
    assert method_name("toy_em") == "toy_em" and colour("toy_em", ["em", "toy_em"]) == SPARE_COLOURS[0]  # no look yet
    assert in_paper_order(["toy_em", "sgd", "em"]) == ["em", "sgd", "toy_em"]


def _imports(path: Path) -> set[str]:
    """The package modules a file imports at run time, anywhere in it (lazy imports included, since they
    hide cycles; those under ``if TYPE_CHECKING:`` are for annotations only)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("scalable_xd")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            if not base.startswith("scalable_xd"):
                continue
            for alias in node.names:  # ``from . import x`` names a module; ``from .x import y`` names y in x
                sub = f"{base}.{alias.name}"
                found.add(sub if _module_path(sub) else base)
    return {m for m in found if _module_path(m)} - {module}


def _module_path(module: str) -> Path | None:
    parts = module.split(".")[1:]
    for candidate in (PACKAGE.joinpath(*parts).with_suffix(".py"), PACKAGE.joinpath(*parts, "__init__.py")):
        if candidate.exists():
            return candidate
    return None


def test_the_settings_import_nothing_of_the_package():
    """The settings are the leaf every layer reads: not even an import for annotations leads back up."""
    tree = ast.parse((PACKAGE / "settings.py").read_text())
    taken = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not [line for line in taken if line.startswith("from .") or "scalable_xd" in line], taken


def test_the_package_has_no_import_cycle():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for m in _imports(path) if m != "scalable_xd"}  # the top package only re-exports
    assert graph["scalable_xd.fit.methods"] >= {
        "scalable_xd.fit.families.minibatch_em",
        "scalable_xd.fit.families.split_merge",
    }  # lazy
    state, cycles = {}, []

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(trail[trail.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)

"""Write workflow/envs/scalable_xd.yaml with exact versions: the packages of pyproject.toml's core, `data`,
`plots` and `catalog` groups at the versions installed in the current environment (the one the test suite passed in),
so that `--use-conda` builds the same environment every time. environment.yml keeps the lower bounds
for development. `--check` fails (exit 1) when a pin no longer satisfies pyproject.toml's lower bound.

    python workflow/scripts/pin_env.py [--check]
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import version
from pathlib import Path

import tomllib
import yaml
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
ENV = REPO / "workflow" / "envs" / "scalable_xd.yaml"
CONDA_NAMES = {"torch": "pytorch", "matplotlib": "matplotlib-base"}
# Not a Python package: conda-forge's C++ toolchain, which torch.compile builds with (Triton's launchers on a
# GPU; its C++ backend on a CPU without numba).
CXX_COMPILER = "cxx-compiler ==1.9.0"
HEADER = """\
# Dependencies of every rule (the rules run this checkout's src/ on PYTHONPATH; see rules/common.smk).
# Exact versions, so that `--use-conda` builds the same environment every time: written by
# workflow/scripts/pin_env.py from the environment the test suite passed in; tests/project/test_environment.py
# checks them against pyproject.toml. environment.yml (development) keeps lower bounds.
"""


def lower_bounds(groups=("data", "plots", "catalog")) -> dict[str, str]:
    """{pip name: lower bound} of pyproject.toml's core dependencies and the named extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"]) + [line for g in groups for line in project["optional-dependencies"][g]]
    bounds = {}
    for line in lines:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[a-z,]+\])?>=([0-9.]+)", line.replace(" ", ""))
        if match and match.group(1) != "scalable-xd":
            bounds[match.group(1)] = match.group(2)
    return bounds


def pinned_text() -> str:
    """The env file for the installed versions (a local build tag such as +cpu dropped)."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    deps = [f"python ={python}"]  # conda's form for any 3.x.y
    for name in lower_bounds():
        deps.append(f"{CONDA_NAMES.get(name, name)} =={version(name).split('+')[0]}")
    deps.insert(3, CXX_COMPILER)  # after pytorch, as in environment.yml
    body = yaml.safe_dump({"channels": ["conda-forge", "nodefaults"], "dependencies": deps}, sort_keys=False)
    return HEADER + body


def stale_pins() -> list[str]:
    """Pins of the committed env file below pyproject.toml's lower bounds, or packages missing from it."""
    pins = {}
    for entry in yaml.safe_load(ENV.read_text())["dependencies"]:
        name, _, pin = entry.partition(" ==")
        pins[name] = pin or None  # python, pinned to its minor version
    problems = []
    for name, bound in lower_bounds().items():
        conda = CONDA_NAMES.get(name, name)
        if conda not in pins:
            problems.append(f"{conda} is in pyproject.toml but not pinned in {ENV.name}")
        elif Version(pins[conda]) < Version(bound):
            problems.append(f"{conda} =={pins[conda]} is below pyproject.toml's >={bound}")
    return problems


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        problems = stale_pins()
        print("\n".join(problems) or f"{ENV.relative_to(REPO)} satisfies pyproject.toml")
        sys.exit(1 if problems else 0)
    ENV.write_text(pinned_text())
    print(f"wrote {ENV.relative_to(REPO)}")

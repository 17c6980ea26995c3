"""pyproject.toml, environment.yml, the workflow's conda env and the configs stay consistent."""

import re
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
CONDA_NAMES = {"torch": "pytorch", "matplotlib": "matplotlib-base"}
# Not Python packages, so not in pyproject.toml: the C++ toolchain that torch.compile builds with on CPU.
CONDA_ONLY = {"cxx-compiler"}


def _pyproject_requirements(*groups: str) -> dict[str, str]:
    """{conda name: lower bound} of the core dependencies and the named extras (self-references skipped)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for group in groups:
        lines += project["optional-dependencies"][group]
    requirements = {}
    for line in lines:
        line = line.split(";")[0]  # environment markers (triton: Linux x86-64) are pip's, not conda's
        # an extra such as snakemake[reports] is the conda-forge package itself (which has the extras' deps)
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[(?!.*scalable)[a-z,]+\])?>=([0-9.]+)", line.replace(" ", ""))
        if match is None:
            assert line.startswith("scalable-xd["), f"unexpected requirement form {line!r}"
            continue
        requirements[CONDA_NAMES.get(match.group(1), match.group(1))] = match.group(2)
    return requirements


def _conda_requirements(path: Path) -> dict[str, str]:
    requirements = {}
    for entry in yaml.safe_load(path.read_text())["dependencies"]:
        if isinstance(entry, str) and entry not in ("pip",):
            name, _, bound = entry.partition(" >=")
            requirements[name] = bound
    return requirements


def test_workflow_env_pins_exactly_what_the_rules_import():
    entries = yaml.safe_load((REPO / "workflow" / "envs" / "scalable_xd.yaml").read_text())["dependencies"]
    pins = dict(entry.split(" ", 1) for entry in entries)
    assert re.fullmatch(r"=3\.1[0-9]", pins.pop("python"))
    assert all(re.fullmatch(r"==[0-9]+(\.[0-9]+)+", pin) for pin in pins.values()), pins  # exact, no ranges
    wanted = _pyproject_requirements("data", "plots", "catalog")
    assert pins.keys() == wanted.keys() | CONDA_ONLY
    for name, bound in wanted.items():  # each pin satisfies pyproject.toml's lower bound
        assert Version(pins[name].removeprefix("==")) >= Version(bound), name


def test_pin_script_writes_the_same_packages_and_checks_bounds(monkeypatch):
    sys.path.insert(0, str(REPO / "workflow" / "scripts"))
    import pin_env

    written = yaml.safe_load(pin_env.pinned_text())["dependencies"]
    committed = yaml.safe_load(pin_env.ENV.read_text())["dependencies"]
    assert [e.split(" ")[0] for e in written] == [e.split(" ")[0] for e in committed]
    assert pin_env.stale_pins() == []
    monkeypatch.setattr(pin_env, "lower_bounds", lambda: {"numpy": "99.0", "newpkg": "1.0"})
    assert pin_env.stale_pins() == [
        f"numpy =={dict(e.split(' ==') for e in committed if '==' in e)['numpy']} is below pyproject.toml's >=99.0",
        "newpkg is in pyproject.toml but not pinned in scalable_xd.yaml",
    ]


def test_environment_yml_mirrors_pyproject():
    env = _conda_requirements(REPO / "environment.yml")
    wanted = _pyproject_requirements("data", "plots", "workflow", "catalog", "test")
    assert CONDA_ONLY <= env.keys()
    assert {k: v for k, v in env.items() if k != "python" and k not in CONDA_ONLY} == wanted
    python = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert env["python"] == python.removeprefix(">=")


def test_every_rule_names_an_existing_conda_env_and_a_log():
    rules = list((REPO / "workflow" / "rules").glob("*.smk"))
    common = (REPO / "workflow" / "rules" / "common.smk").read_text()
    env = re.search(r'^ENV = "(.+)"$', common, flags=re.M).group(1)
    assert (REPO / "workflow" / "rules" / env).resolve().exists()
    for path in rules:
        text = path.read_text()
        n_rules = len(re.findall(r"^(?:rule|checkpoint) \w+:", text, flags=re.M))
        assert text.count("    conda:\n        ENV") == n_rules, path.name
        assert text.count("    log:\n") == n_rules, path.name


@pytest.mark.parametrize("name", sorted(path.stem for path in (REPO / "config").glob("*.yaml")))
def test_configs_validate_against_the_schema(name):
    from snakemake.utils import validate

    config = yaml.safe_load((REPO / "config" / f"{name}.yaml").read_text())
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))  # fills in the defaults
    assert config["report"]["figure_K"] in config["fit"]["n_components"]
    assert config["report"]["seed"] in config["fit"]["seeds"]
    if name in ("config", "mock", "mock_cpu"):  # the paper's protocol, appendix B
        fit = config["fit"]
        assert (fit["n_components"], fit["seeds"], fit["epochs"], fit["batch_size"]) == (
            [64, 128, 256, 512],
            list(range(10)),
            20,
            500,
        )
        assert (
            fit["step_schedule"],
            fit["step_size"],
            fit["step_decay"],
            fit["lr"],
            fit["lr_decay"],
            fit["decay_epoch"],
            fit["w"],
            fit["tol"],
        ) == ("step", 0.01, 0.5, 0.01, 0.1, 10, 0.001, None)
        assert config["data"]["n_rows"] == 2_000_000 and config["init"]["kmeans_epochs"] == 10

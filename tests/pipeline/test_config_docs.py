"""config/README.md documents every key of the config schema, with the defaults the code uses."""

import importlib.util
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _docs_module():
    spec = importlib.util.spec_from_file_location("config_docs", REPO / "workflow" / "scripts" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_readme_is_generated_and_fresh():
    assert _docs_module().main(["--check"]) == 0, "run python workflow/scripts/config_docs.py"


def test_every_schema_key_has_a_meaning():
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())["properties"]
    text = (REPO / "config" / "README.md").read_text()
    for block, spec in schema.items():
        assert f"## `{block}`" in text
        for key in spec.get("properties", {}):
            row = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
            assert row.split("|")[3].strip(), f"{block}.{key} has no meaning in config/README.md"


def test_fit_settings_are_described_once_in_fit_settings():
    """A fit setting's meaning is its ``FitSettings`` help (the CLI's --help, the estimator's and this
    file's), so the schema states none of its own that could drift from it."""
    import dataclasses

    from scalable_xd.settings import FitSettings

    fields = {f.name: f.metadata["help"] for f in dataclasses.fields(FitSettings)}
    fit = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())["properties"]["fit"]
    for key, prop in fit["properties"].items():
        assert key not in fields or "description" not in prop, f"fit.{key}: the schema repeats FitSettings' help"
    text = (REPO / "config" / "README.md").read_text()
    for key in fit["properties"].keys() & fields.keys():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
        assert " ".join(fields[key].split()) in row, key

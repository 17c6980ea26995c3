"""config/README.md documents every key of the config schema, with the defaults the code uses."""

import importlib.util
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


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

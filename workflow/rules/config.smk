# The config checked against the schema, whose defaults then fill in the optional settings.

import jsonschema
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

SCHEMA = "../schemas/config.schema.yaml"


def check_config(config):
    """The config against the schema, each mistake in one line naming its key (snakemake's own message
    gives one, followed by hundreds of lines of schema)."""
    with open(workflow.source_path(SCHEMA)) as handle:
        schema = yaml.safe_load(handle)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(config), key=lambda e: list(e.path))
    if errors:
        lines = [
            f"the config's {'.'.join(str(part) for part in e.absolute_path) or 'the top level'}: {e.message}"
            for e in errors
        ]
        raise WorkflowError("\n".join(lines + ["see config/README.md"]))


check_config(config)
validate(config, SCHEMA)

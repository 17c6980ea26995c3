# The config checked against the schema, whose defaults then fill in the optional settings.

import jsonschema
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

SCHEMA = "../schemas/config.schema.yaml"


def check_config(config):
    """The config against the schema, its first mistake in one line naming the key (snakemake's own
    message follows it with hundreds of lines of schema)."""
    with open(workflow.source_path(SCHEMA)) as handle:
        schema = yaml.safe_load(handle)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(config), key=lambda e: list(e.path))
    if errors:
        where = ".".join(str(part) for part in errors[0].absolute_path) or "the top level"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise WorkflowError(f"the config's {where}: {errors[0].message}{more}; see config/README.md")


check_config(config)
validate(config, SCHEMA)

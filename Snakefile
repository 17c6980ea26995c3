# The scalable-xd experiment: regenerate the tables and figures of "Scalable Extreme Deconvolution"
# (Ritchie & Murray 2019) from the Gaia DR2 archive, or offline from a DR2-like mock.
#
#   snakemake --cores all --use-conda                              # the paper (config/config.yaml)
#   snakemake --cores all --configfile config/demo.yaml            # quick start, offline (run times: docs/reproducing.md)
#   snakemake --report report.html --configfile config/demo.yaml   # captioned HTML report

from snakemake.utils import min_version

min_version("8.0")

# A --configfile replaces the paper's config instead of extending it: each config states only what differs
# from the schema's defaults, so keys of config/config.yaml must not leak into it.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"



include: "workflow/rules/config.smk"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"


if config["data"]["source"] == "bulk":  # only then is the HTTP storage plugin needed

    include: "workflow/rules/bulk.smk"


include: "workflow/rules/init.smk"
include: "workflow/rules/fit.smk"
include: "workflow/rules/report.smk"


report: "workflow/report/workflow.rst"


rule all:
    input:
        final_outputs(),
        survey_figures,
    default_target: True

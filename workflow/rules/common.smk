# Shared names and helpers for the rule files. Every rule runs the checkout's own scalable_xd package
# (src/ on PYTHONPATH) with the dependencies of workflow/envs/scalable_xd.yaml, so results always come
# from this code, with or without --use-conda.

import hashlib
import json
import os
import shlex
import shutil

import yaml

NAME = config["name"]
RESULTS = f"results/{NAME}"
DATA = f"{RESULTS}/data"
METHODS = config["fit"]["methods"]  # methods or names of fit.variants
VARIANTS = config["fit"]["variants"]
KS = config["fit"]["n_components"]
SEEDS = config["fit"]["seeds"]
FIGURE_K = config["report"]["figure_K"]
FIGURE_SEED = config["report"]["seed"]
ERRORS_K = config["report"]["errors_K"] or min(config["fit"]["n_components"])  # the parameter errors' model
ERRORS_METHOD = config["report"]["errors_method"] or ("em" if "em" in METHODS else config["report"]["sky_method"])
ENV = "../envs/scalable_xd.yaml"
# Optional settings are filled in from the schema's defaults by validate() in the Snakefile.


wildcard_constraints:
    method="|".join(METHODS),
    K=r"\d+",
    seed=r"\d+",

# The methods the schema allows a variant (tests/estimator/test_settings.py holds them equal to scalable_xd.fit.methods).
with open(os.path.join(workflow.basedir, "workflow", "schemas", "config.schema.yaml")) as _schema:
    FIT_METHODS = yaml.safe_load(_schema)["properties"]["fit"]["properties"]["variants"]["additionalProperties"][
        "properties"]["method"]["enum"]
_unknown = [m for m in METHODS if m not in VARIANTS and m not in FIT_METHODS]
if _unknown:
    raise ValueError(f"fit.methods {_unknown} are neither methods nor names of fit.variants {sorted(VARIANTS)}")
if FIGURE_K not in KS:
    raise ValueError(f"report.figure_K = {FIGURE_K} is not one of fit.n_components {KS}")
if ERRORS_K not in KS:
    raise ValueError(f"report.errors_K = {ERRORS_K} is not one of fit.n_components {KS}")
if ERRORS_METHOD not in METHODS:
    raise ValueError(f"report.errors_method = {ERRORS_METHOD} is not one of fit.methods {METHODS}")
if FIGURE_SEED not in SEEDS:
    raise ValueError(f"report.seed = {FIGURE_SEED} is not one of fit.seeds {SEEDS}")
if config["report"]["sky_method"] not in METHODS:
    raise ValueError(f"report.sky_method = {config['report']['sky_method']} is not one of fit.methods {METHODS}")

CONFIG_HASH = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
SRC = os.path.join(workflow.basedir, "src")
CLI = f"PYTHONPATH={SRC}${{PYTHONPATH:+:$PYTHONPATH}} python -m scalable_xd"
# fit.processes > 1: each fit runs data-parallel, its processes started by torchrun on this machine.
# fit.nodes > 1 (a SLURM allocation of that many nodes): srun starts one torchrun per node, and they meet
# at the allocation's first node (c10d rendezvous), fit.processes processes on each.
FIT_PROCESSES = config["fit"]["processes"]
FIT_NODES = config["fit"]["nodes"]
if FIT_NODES > 1:
    FIT_CLI = CLI.replace(
        "python -m scalable_xd",
        f"srun --nodes {FIT_NODES} --ntasks-per-node 1 python -m torch.distributed.run --nnodes {FIT_NODES} "
        f"--nproc-per-node {FIT_PROCESSES} --rdzv-backend c10d --rdzv-id $SLURM_JOB_ID "
        '--rdzv-endpoint "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):29500" -m scalable_xd',
    )
elif FIT_PROCESSES > 1:
    FIT_CLI = CLI.replace(
        "python -m scalable_xd",
        f"python -m torch.distributed.run --standalone --nproc-per-node {FIT_PROCESSES} -m scalable_xd",
    )
else:
    FIT_CLI = CLI

# Fits get every core unless told otherwise, so that concurrent jobs do not share (and distort) timings.
def _all_cores():
    """The cores snakemake was given; 1 for commands that run no job and set none (--report)."""
    from snakemake.exceptions import WorkflowError

    try:
        return workflow.cores or 1
    except WorkflowError:
        return 1


FIT_THREADS = config["fit"]["threads"] or _all_cores()
_device = config["fit"]["device"]
FIT_GPUS = 1 if _device.startswith("cuda") or (_device == "auto" and shutil.which("nvidia-smi")) else 0


# data.source bulk: ESA's bulk files, checked, then one HATS catalogue (workflow/rules/bulk.smk).
BULK_DIR = "resources/gaia_dr2_bulk"
HATS_CATALOGUE = "resources/gaia_dr2_hats/gaia_dr2"


def raw_catalogue():
    """The raw catalogue: the archive query's manifest, a mock Parquet file, the HATS catalogue of the bulk
    files, or a file of another survey (data.raw)."""
    if config["data"]["source"] == "file":
        return config["data"]["raw"]
    if config["data"]["source"] == "bulk":
        return HATS_CATALOGUE
    n = config["data"]["n_rows"]
    if config["data"]["source"] == "gaia":
        return f"resources/gaia_dr2/random_index_lt_{n}.json"
    return f"resources/mock/mock_n{n}_seed{config['data']['mock_seed']}.parquet"


# Truth metrics (``scalable_xd.pipeline.truth``) need the mock's noise-free values: real data have none.
# The references that put them on a scale can be left out (config truth.references) where they cost too much.
HAS_REFERENCES = config["data"]["source"] == "mock" and config["truth"]["references"]
REFERENCE_KINDS = ["oracle", "noisy", "achievable"]


def reference_budget(kind):
    """The reference's options: each kind runs SQUAREM-accelerated batch EM to the truth block's tol."""
    truth = config["truth"]
    return f" --epochs {truth['reference_epochs']} --tol {truth['reference_tol']} --acceleration squarem"


def reference_metrics(K):
    """The references a fit at K is scored against: one per kind and K, from the report seed's k-means init
    (a reference estimates what a K-component mixture can do, not a seed's luck)."""
    if not HAS_REFERENCES:
        return []
    return [reference_file(kind, K, FIGURE_SEED) for kind in REFERENCE_KINDS]


# Keys of the config's fit block that the workflow itself uses; every other key is a fit setting
# (scalable_xd.settings.FitSettings) and goes to `scalable-xd fit` as an option of the same name.
WORKFLOW_FIT_KEYS = ("methods", "variants", "n_components", "seeds", "threads", "processes", "nodes", "stream_window",
                     "checkpoint_every", "job_per_seed")


def _option(key, value):
    flag = f"--{key.replace('_', '-')}"
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {'none' if value is None else shlex.quote(str(value))}"


def method_settings(method=None):
    """The config's fit block; with ``method``, that method's or variant's (a variant's settings replace the
    block's, and name the method)."""
    fit = dict(config["fit"])
    if method is not None:
        fit.update(VARIANTS.get(method, {"method": method}))
    return fit


def fit_options(keys=None, method=None):
    """The config's fit settings (all, or ``keys``) as command-line options; with ``method``, those of that
    method or variant (``method_settings``)."""
    fit = method_settings(method)
    keys = [k for k in fit if k not in WORKFLOW_FIT_KEYS] if keys is None else keys
    return " ".join(_option(key, fit[key]) for key in keys)


def stream_window(method):
    """Rows a fit of ``method`` (or variant) streams from its splits at a time: fit.stream_window, or 0 (in
    memory) for a fit under a selection, whose splits the fit step cuts in memory."""
    return 0 if method_settings(method).get("selection") else config["fit"]["stream_window"]


# Where each step's outputs go: called with values for a file, or with "{K}"-style wildcards for a rule.
def fit_dir(method, K, seed):
    return f"{RESULTS}/fits/{method}/K{K}_seed{seed}"


def init_file(K, seed):
    return f"{RESULTS}/init/K{K}_seed{seed}.npz"


def reference_file(kind, K, seed):
    return f"{RESULTS}/references/{kind}/K{K}_seed{seed}.json"


def all_metrics():
    return [f"{fit_dir(m, k, s)}/metrics.json" for m in METHODS for k in KS for s in SEEDS]


def selection_pair():
    """The selection experiment's (naive, aware) variants of fit.methods: the first cut by a selection and
    fitted as they are, and the first fitted aware of the same selection; None where the run has none."""
    cut = {m: VARIANTS[m] for m in METHODS if m in VARIANTS and VARIANTS[m].get("selection")}
    for aware, settings in cut.items():
        if settings.get("selection_aware", True):
            for naive, other in cut.items():
                if not other.get("selection_aware", True) and other["selection"] == settings["selection"]:
                    return naive, aware
    return None


SELECTION_PAIR = selection_pair()


def figure_model(method):
    return f"{fit_dir(method, FIGURE_K, FIGURE_SEED)}/model.npz"


def survey_figures(wildcards):
    """The figures that read features by role which the survey's features allow (Figure 2's sky density,
    the denoised colour-magnitude diagram), as the features' summary lists them (``report.figures_for``)."""
    path = checkpoints.features.get().output.summary
    with open(path) as summary:
        figures = json.load(summary).get("figures")
    if figures is None:
        from snakemake.exceptions import WorkflowError

        raise WorkflowError(f"{path} lists no figures (written by an older version): run the features step again")
    return [f"{RESULTS}/figures/{name}.{ext}" for name in figures for ext in ("png", "pdf")]


def final_outputs():
    """The final targets but ``survey_figures``: each fit's model and metrics (deliverables in their own
    right, and requested so that deleting one reruns that fit and what depends on it), the tables and the
    figures every survey has."""
    fits = [f"{fit_dir(m, k, s)}/{name}" for m in METHODS for k in KS for s in SEEDS for name in ("model.npz", "metrics.json")]
    tables = [f"{RESULTS}/tables/loglik.{ext}" for ext in ("csv", "md", "tex")] + [f"{RESULTS}/claims.md"]
    figures = [f"{RESULTS}/figures/{name}.{ext}" for name in ("timing_vs_K", f"training_curves_K{FIGURE_K}")
               for ext in ("png", "pdf")]
    corners = [f"{RESULTS}/figures/corner_{m}_K{FIGURE_K}.{ext}" for m in METHODS for ext in ("png", "pdf")]
    denoised = [f"{RESULTS}/denoised/test.parquet", f"{RESULTS}/tables/calibration.json",
                f"{RESULTS}/tables/calibration.md"]
    selection = [f"{RESULTS}/figures/selection.{ext}" for ext in ("png", "pdf")] if SELECTION_PAIR else []
    errors = [f"{RESULTS}/tables/parameter_errors_K{ERRORS_K}.{ext}" for ext in ("json", "md")]
    return fits + tables + figures + corners + denoised + selection + errors

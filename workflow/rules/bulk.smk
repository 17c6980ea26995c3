# All of DR2's gaia_source from ESA's bulk files (data.source: bulk; see scalable_xd.pipeline.gaia.bulk):
# the index -> each file through Snakemake's HTTP storage plugin, kept once its MD5 sum matches
# -> one HATS catalogue (hats-import), which the features rule reads like any raw catalogue.

BULK = config["data"]["bulk"]


# Downloads run where snakemake runs (a cluster's login node), not as 61,234 batch jobs.
localrules:
    bulk_index,
    bulk_file,


checkpoint bulk_index:
    """The files to fetch and their MD5 sums: ESA's MD5SUM.txt (its first data.bulk.n_files entries, or
    all). A checkpoint: the files are known only once it has run, so a dry run needs no network."""
    output:
        f"{BULK_DIR}/MD5SUM.txt",
    params:
        cli=CLI,
        url=BULK["url"] + "MD5SUM.txt",
        n_files=BULK["n_files"],
    log:
        f"{RESULTS}/logs/bulk/index.log",
    conda:
        ENV
    shell:
        "{params.cli} bulk-index --url {params.url} --n-files {params.n_files} --output {output} 2> {log}"


rule bulk_file:
    """One bulk file, fetched by the HTTP storage plugin and kept only if its MD5 sum matches the index."""
    input:
        csv=storage.http(BULK["url"] + "{name}.csv.gz"),
        index=f"{BULK_DIR}/MD5SUM.txt",
    output:
        f"{BULK_DIR}/csv/{{name}}.csv.gz",
    params:
        cli=CLI,
    log:
        f"{RESULTS}/logs/bulk/{{name}}.log",
    conda:
        ENV
    shell:
        "{params.cli} bulk-check --input {input.csv} --index {input.index} --output {output} 2> {log}"


def bulk_files(wildcards):
    """Every checked file the index lists (known once the bulk_index checkpoint has run)."""
    with open(checkpoints.bulk_index.get().output[0]) as index:
        return [f"{BULK_DIR}/csv/{line.split()[-1]}" for line in index if line.strip()]


rule hats_catalogue:
    """The checked files as one HEALPix-partitioned catalogue (hats-import), written once."""
    input:
        files=bulk_files,
        index=f"{BULK_DIR}/MD5SUM.txt",
    output:
        directory(HATS_CATALOGUE),
    params:
        cli=CLI,
        csv_dir=f"{BULK_DIR}/csv",
        pixel_threshold=BULK["pixel_threshold"],
        highest_order=BULK["highest_order"],
    threads: BULK["workers"]
    log:
        f"{RESULTS}/logs/bulk/hats_import.log",
    conda:
        ENV
    shell:
        "{params.cli} hats-import --index {input.index} --csv-dir {params.csv_dir} --output {output} "
        "--pixel-threshold {params.pixel_threshold} --highest-order {params.highest_order} "
        "--workers {threads} 2> {log}"

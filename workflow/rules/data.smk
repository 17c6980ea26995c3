# Raw catalogue (archive query or mock) -> features, compact noise covariances, 80/10/10 split.


rule query_gaia:
    """Download the Gaia DR2 rows with random_index < n_rows, chunk by chunk (resumable: chunks live
    beside the manifest and finished ones are never fetched again)."""
    output:
        manifest="resources/gaia_dr2/random_index_lt_{n_rows}.json",
    params:
        cli=CLI,
        chunk_dir=lambda wildcards, output: output.manifest.removesuffix(".json"),
        chunk_rows=config["data"]["chunk_rows"],
        tap_url=config["data"]["tap_url"],
    log:
        f"{RESULTS}/logs/query_gaia_{{n_rows}}.log",
    conda:
        ENV
    shell:
        "{params.cli} query --n-rows {wildcards.n_rows} --out-dir {params.chunk_dir} "
        "--chunk-rows {params.chunk_rows} --tap-url {params.tap_url} --manifest {output.manifest} 2> {log}"


rule mock_catalogue:
    """A Gaia-DR2-like mock with the query's columns plus the true values (offline stand-in)."""
    output:
        "resources/mock/mock_n{n_rows}_seed{seed}.parquet",
    params:
        cli=CLI,
    log:
        f"{RESULTS}/logs/mock_n{{n_rows}}_seed{{seed}}.log",
    conda:
        ENV
    shell:
        "{params.cli} mock --n-rows {wildcards.n_rows} --seed {wildcards.seed} --output {output} 2> {log}"


checkpoint features:
    """The survey's features and per-star noise (Gaia: 7 sigmas + 10 correlations), split 80/10/10; a
    checkpoint, as its summary names the figures the features' roles allow (``survey_figures``)."""
    input:
        raw=raw_catalogue(),
    output:
        train=f"{DATA}/train.parquet",
        val=f"{DATA}/val.parquet",
        test=f"{DATA}/test.parquet",
        summary=f"{DATA}/features.json",
    params:
        cli=CLI,
        out_dir=lambda wildcards, output: os.path.dirname(output.summary),
        mode=config["data"]["covariance_mode"],
        split_seed=config["data"]["split_seed"],
        survey=config["data"]["survey"],
    log:
        f"{RESULTS}/logs/features.log",
    conda:
        ENV
    shell:
        "{params.cli} features --input {input.raw} --out-dir {params.out_dir} --mode {params.mode} "
        "--split-seed {params.split_seed} --survey {params.survey} 2> {log}"

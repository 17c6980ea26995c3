# One fit per (method, K, seed): parameters and a metrics JSON (log-likelihoods, timings, curve).


rule fit:
    """Fit an XD mixture with one method from the shared k-means init; checkpoints every epoch and
    resumes from the checkpoint if a previous attempt was interrupted."""
    input:
        train=f"{DATA}/train.parquet",
        val=f"{DATA}/val.parquet",
        test=f"{DATA}/test.parquet",
        init=init_file("{K}", "{seed}"),
        references=lambda wildcards: reference_metrics(wildcards.K),
    output:
        model=f"{fit_dir('{method}', '{K}', '{seed}')}/model.npz",
        metrics=f"{fit_dir('{method}', '{K}', '{seed}')}/metrics.json",
    params:
        cli=FIT_CLI,
        per_process=lambda wildcards, threads: max(1, threads // FIT_PROCESSES),
        stream_window=lambda wildcards: stream_window(wildcards.method),
        checkpoint_every=config["fit"]["checkpoint_every"],
        checkpoint=lambda wildcards, output: output.model.replace("model.npz", "checkpoint.pt"),
        settings=lambda wildcards: fit_options(method=wildcards.method),
        tag=NAME,
        config_hash=CONFIG_HASH,
        references=lambda wildcards, input: f"--reference {' '.join(input.references)}" if input.references else "",
    threads: FIT_THREADS
    resources:
        gpu=FIT_GPUS * FIT_PROCESSES,  # one GPU per process of a data-parallel fit (per node)
        nodes=FIT_NODES,
    log:
        f"{RESULTS}/logs/fit/{{method}}/K{{K}}_seed{{seed}}.log",
    conda:
        ENV
    shell:
        "{params.cli} fit --train {input.train} --val {input.val} --test {input.test} --init {input.init} "
        "--n-components {wildcards.K} --seed {wildcards.seed} --label {wildcards.method} {params.settings} "
        "--threads {params.per_process} --stream-window {params.stream_window} "
        "--checkpoint {params.checkpoint} --checkpoint-every {params.checkpoint_every} --tag {params.tag} --config-hash {params.config_hash} "
        "{params.references} --output-model {output.model} --output-metrics {output.metrics} 2> {log}"


rule reference:
    """A reference for the truth metrics (mock only): batch EM from the k-means init on the true values
    (oracle), on the noisy values with their noise ignored (noisy), or XD run to convergence with SQUAREM
    (achievable); scored on the test stars' true values. Always float64: with no noise a component's
    scatter can be nearly singular, which float32 sums miss."""
    input:
        train=f"{DATA}/train.parquet",
        test=f"{DATA}/test.parquet",
        init=init_file("{K}", "{seed}"),
    output:
        reference_file("{kind}", "{K}", "{seed}"),
    wildcard_constraints:
        kind="|".join(REFERENCE_KINDS),
    params:
        cli=CLI,
        settings=lambda wildcards: fit_options(("w", "w_scale", "device", "backend")) + reference_budget(wildcards.kind),
    threads: FIT_THREADS
    resources:
        gpu=FIT_GPUS,
    log:
        f"{RESULTS}/logs/references/{{kind}}/K{{K}}_seed{{seed}}.log",
    conda:
        ENV
    shell:
        "{params.cli} reference --train {input.train} --test {input.test} --init {input.init} "
        "--n-components {wildcards.K} --kind {wildcards.kind} --seed {wildcards.seed} {params.settings} "
        "--threads {threads} "
        "--output-metrics {output} 2> {log}"

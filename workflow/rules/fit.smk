# One job per (method, K) fits every seed, one after another on the data read once: each seed's parameters
# and metrics JSON (log-likelihoods, timings, curve) are its own, as if fitted alone. With fit.job_per_seed
# each (method, K, seed) is a job of its own ("{seed}" its one seed), timed alone and final as it ends.
JOB_SEEDS = ["{seed}"] if config["fit"]["job_per_seed"] else SEEDS


rule fit:
    """Fit an XD mixture with one method at one K for every seed of the job (JOB_SEEDS), each from its own
    k-means init; each seed checkpoints every epoch, and a job stopped part way resumes from the seed it was
    in (the seeds before it read back from their checkpoints)."""
    input:
        train=f"{DATA}/train.parquet",
        val=f"{DATA}/val.parquet",
        test=f"{DATA}/test.parquet",
        init=[init_file("{K}", seed) for seed in JOB_SEEDS],
        references=lambda wildcards: reference_metrics(wildcards.K),
    output:
        model=[f"{fit_dir('{method}', '{K}', seed)}/model.npz" for seed in JOB_SEEDS],
        metrics=[f"{fit_dir('{method}', '{K}', seed)}/metrics.json" for seed in JOB_SEEDS],
    params:
        cli=FIT_CLI,
        seeds=lambda wildcards: wildcards.get("seed") or " ".join(map(str, SEEDS)),
        per_process=lambda wildcards, threads: max(1, threads // FIT_PROCESSES),
        stream_window=lambda wildcards: stream_window(wildcards.method),
        checkpoint_every=config["fit"]["checkpoint_every"],
        checkpoints=lambda wildcards, output: " ".join(path.replace("model.npz", "checkpoint.pt") for path in output.model),
        settings=lambda wildcards: fit_options(method=wildcards.method),
        tag=NAME,
        config_hash=CONFIG_HASH,
        references=lambda wildcards, input: f"--reference {' '.join(input.references)}" if input.references else "",
    threads: FIT_THREADS
    resources:
        gpu=FIT_GPUS * FIT_PROCESSES,  # one GPU per process of a data-parallel fit (per node)
        nodes=FIT_NODES,
    log:
        f"{RESULTS}/logs/fit/{{method}}/K{{K}}" + ("_seed{seed}" if config["fit"]["job_per_seed"] else "") + ".log",
    conda:
        ENV
    shell:
        "{params.cli} fit --train {input.train} --val {input.val} --test {input.test} --init {input.init} "
        "--n-components {wildcards.K} --seed {params.seeds} --label {wildcards.method} {params.settings} "
        "--threads {params.per_process} --stream-window {params.stream_window} "
        "--checkpoint {params.checkpoints} --checkpoint-every {params.checkpoint_every} --tag {params.tag} --config-hash {params.config_hash} "
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

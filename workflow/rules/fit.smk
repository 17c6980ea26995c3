# One fit per (method, K, seed): parameters and a metrics JSON (log-likelihoods, timings, curve).


rule fit:
    """Fit an XD mixture with one method from the shared k-means init; checkpoints every epoch and
    resumes from the checkpoint if a previous attempt was interrupted."""
    input:
        train=f"{DATA}/train.parquet",
        val=f"{DATA}/val.parquet",
        test=f"{DATA}/test.parquet",
        init=f"{RESULTS}/init/K{{K}}_seed{{seed}}.npz",
    output:
        model=f"{RESULTS}/fits/{{method}}/K{{K}}_seed{{seed}}/model.npz",
        metrics=f"{RESULTS}/fits/{{method}}/K{{K}}_seed{{seed}}/metrics.json",
    params:
        cli=CLI,
        checkpoint=lambda wildcards, output: output.model.replace("model.npz", "checkpoint.pt"),
        settings=" ".join(
            f"--{key.replace('_', '-')} {config['fit'][key]}"
            for key in ("epochs", "batch_size", "step_size", "step_decay", "lr", "lr_decay", "decay_epoch",
                        "w", "device", "dtype")
        )
        + (" --compile" if config["fit"]["compile"] else ""),
        tag=NAME,
        config_hash=CONFIG_HASH,
    threads: FIT_THREADS
    resources:
        gpu=FIT_GPUS,
    log:
        f"{RESULTS}/logs/fit/{{method}}/K{{K}}_seed{{seed}}.log",
    conda:
        ENV
    shell:
        "{params.cli} fit --train {input.train} --val {input.val} --test {input.test} --init {input.init} "
        "--method {wildcards.method} --seed {wildcards.seed} {params.settings} --threads {threads} "
        "--checkpoint {params.checkpoint} --tag {params.tag} --config-hash {params.config_hash} "
        "--output-model {output.model} --output-metrics {output.metrics} 2> {log}"

# Minibatch k-means initial weights and means, one per (K, seed), shared by every method.


rule kmeans:
    """Minibatch k-means (Sculley 2010) on the training features: counts -> weights, centroids -> means."""
    input:
        train=f"{DATA}/train.parquet",
    output:
        init_file("{K}", "{seed}"),
    params:
        cli=CLI,
        epochs=config["init"]["kmeans_epochs"],
        batch_size=config["init"]["kmeans_batch_size"],
        max_rows=config["init"]["kmeans_max_rows"],
        device=config["fit"]["device"],
        dtype=config["fit"]["dtype"],
    threads: FIT_THREADS
    resources:
        gpu=FIT_GPUS,
    log:
        f"{RESULTS}/logs/kmeans/K{{K}}_seed{{seed}}.log",
    conda:
        ENV
    shell:
        "{params.cli} kmeans --train {input.train} --n-components {wildcards.K} --seed {wildcards.seed} "
        "--epochs {params.epochs} --batch-size {params.batch_size} --device {params.device} "
        "--dtype {params.dtype} --threads {threads} --max-rows {params.max_rows} --output {output} 2> {log}"

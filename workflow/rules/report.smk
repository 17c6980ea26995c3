# Table 1, Figure 1 (training curves, timing against K), Figure 2 (sky density), corner plots and the selection experiment.


rule loglik_table:
    """Mean +- sd over seeds of validation (and best-K test) log-likelihoods per method and K."""
    input:
        metrics=all_metrics(),
    output:
        csv=report(f"{RESULTS}/tables/loglik.csv", caption="../report/loglik_table.rst", category="Table 1"),
        md=f"{RESULTS}/tables/loglik.md",
        tex=f"{RESULTS}/tables/loglik.tex",
    params:
        cli=CLI,
        prefix=lambda wildcards, output: output.csv.removesuffix(".csv"),
    log:
        f"{RESULTS}/logs/report/loglik_table.log",
    conda:
        ENV
    shell:
        "{params.cli} table --metrics {input.metrics} --output-prefix {params.prefix} 2> {log}"


rule claims:
    """Each claim of the paper with its verdict on this run and the numbers that decide it."""
    input:
        metrics=all_metrics(),
        calibration=f"{RESULTS}/tables/calibration.json",
    output:
        report(f"{RESULTS}/claims.md", caption="../report/claims.rst", category="Claims"),
    params:
        cli=CLI,
    log:
        f"{RESULTS}/logs/report/claims.log",
    conda:
        ENV
    shell:
        "{params.cli} claims --metrics {input.metrics} --calibration {input.calibration} --output {output} 2> {log}"


rule timing_vs_k:
    """Training time against K per method, +-2 sd over seeds (Figure 1, right)."""
    input:
        metrics=all_metrics(),
    output:
        png=report(f"{RESULTS}/figures/timing_vs_K.png", caption="../report/timing_vs_K.rst", category="Figure 1"),
        pdf=f"{RESULTS}/figures/timing_vs_K.pdf",
    params:
        cli=CLI,
    log:
        f"{RESULTS}/logs/report/timing_vs_K.log",
    conda:
        ENV
    shell:
        "{params.cli} plot-timing --metrics {input.metrics} --output {output.png} {output.pdf} 2> {log}"


rule training_curves:
    """Mean training log-likelihood against time-rescaled epoch at one K (Figure 1, left)."""
    input:
        metrics=[f"{fit_dir(m, FIGURE_K, s)}/metrics.json" for m in METHODS for s in SEEDS],
    output:
        png=report(f"{RESULTS}/figures/training_curves_K{FIGURE_K}.png", caption="../report/training_curves.rst",
                   category="Figure 1"),
        pdf=f"{RESULTS}/figures/training_curves_K{FIGURE_K}.pdf",
    params:
        cli=CLI,
        K=FIGURE_K,
    log:
        f"{RESULTS}/logs/report/training_curves.log",
    conda:
        ENV
    shell:
        "{params.cli} plot-curves --metrics {input.metrics} --n-components {params.K} "
        "--output {output.png} {output.pdf} 2> {log}"


rule sky_density:
    """Sky density of model samples beside the data (Figure 2)."""
    input:
        model=figure_model(config["report"]["sky_method"]),
        metrics=f"{fit_dir(config['report']['sky_method'], FIGURE_K, FIGURE_SEED)}/metrics.json",
        data=f"{DATA}/train.parquet",
    output:
        png=report(f"{RESULTS}/figures/sky_density.png", caption="../report/sky_density.rst", category="Figure 2"),
        pdf=f"{RESULTS}/figures/sky_density.pdf",
    params:
        cli=CLI,
        samples=config["report"]["samples"],
        frame=config["report"]["sky_frame"],
    log:
        f"{RESULTS}/logs/report/sky_density.log",
    conda:
        ENV
    shell:
        "{params.cli} plot-sky --model {input.model} --metrics {input.metrics} --data {input.data} "
        "--n-samples {params.samples} "
        "--frame {params.frame} --output {output.png} {output.pdf} 2> {log}"


rule corner:
    """Corner plot of one method's model samples over the data, every feature."""
    input:
        model=lambda wildcards: figure_model(wildcards.method),
        metrics=lambda wildcards: f"{fit_dir(wildcards.method, FIGURE_K, FIGURE_SEED)}/metrics.json",
        data=f"{DATA}/test.parquet",
    output:
        png=report(f"{RESULTS}/figures/corner_{{method}}_K{FIGURE_K}.png", caption="../report/corner.rst",
                   category="Corner plots", labels={"method": "{method}"}),
        pdf=f"{RESULTS}/figures/corner_{{method}}_K{FIGURE_K}.pdf",
    params:
        cli=CLI,
        samples=config["report"]["samples"],
    log:
        f"{RESULTS}/logs/report/corner_{{method}}.log",
    conda:
        ENV
    shell:
        "{params.cli} plot-corner --model {input.model} --metrics {input.metrics} --data {input.data} "
        "--n-samples {params.samples} "
        "--output {output.png} {output.pdf} 2> {log}"


rule denoise:
    """Each test star's posterior true values under the figure model (the denoised catalogue)."""
    input:
        model=figure_model(config["report"]["sky_method"]),
        data=f"{DATA}/test.parquet",
    output:
        f"{RESULTS}/denoised/test.parquet",
    params:
        cli=CLI,
    log:
        f"{RESULTS}/logs/report/denoise.log",
    conda:
        ENV
    shell:
        "{params.cli} denoise --model {input.model} --data {input.data} --output {output} 2> {log}"


rule calibration:
    """The denoised values' pulls, interval coverage and precision gain against the mock's true values."""
    input:
        f"{RESULTS}/denoised/test.parquet",
    output:
        json=f"{RESULTS}/tables/calibration.json",
        md=report(f"{RESULTS}/tables/calibration.md", caption="../report/calibration.rst", category="Denoised"),
    params:
        cli=CLI,
    log:
        f"{RESULTS}/logs/report/calibration.log",
    conda:
        ENV
    shell:
        "{params.cli} calibrate --denoised {input} --output-json {output.json} --output-md {output.md} 2> {log}"


rule denoised_figure:
    """Colour-magnitude diagrams measured, denoised and true; pulls; precision gain against G."""
    input:
        denoised=f"{RESULTS}/denoised/test.parquet",
        calibration=f"{RESULTS}/tables/calibration.json",
    output:
        png=report(f"{RESULTS}/figures/denoised.png", caption="../report/denoised.rst", category="Denoised"),
        pdf=f"{RESULTS}/figures/denoised.pdf",
    params:
        cli=CLI,
    log:
        f"{RESULTS}/logs/report/denoised_figure.log",
    conda:
        ENV
    shell:
        "{params.cli} plot-denoised --denoised {input.denoised} --calibration {input.calibration} "
        "--output {output.png} {output.pdf} 2> {log}"



rule selection_figure:
    """The population, the naive fit to the cut training stars and the selection-aware fit (a run with the
    fit.variants of the selection experiment: ``selection_pair``)."""
    input:
        naive=figure_model(SELECTION_PAIR[0] if SELECTION_PAIR else "em"),
        aware=figure_model(SELECTION_PAIR[1] if SELECTION_PAIR else "em"),
        data=f"{DATA}/test.parquet",
    output:
        png=report(f"{RESULTS}/figures/selection.png", caption="../report/selection.rst", category="Selection"),
        pdf=f"{RESULTS}/figures/selection.pdf",
    params:
        cli=CLI,
        samples=config["report"]["samples"],
        seed=FIGURE_SEED,
        selection=shlex.quote(VARIANTS[SELECTION_PAIR[1]]["selection"]) if SELECTION_PAIR else "",
    log:
        f"{RESULTS}/logs/report/selection.log",
    conda:
        ENV
    shell:
        "{params.cli} plot-selection --naive {input.naive} --aware {input.aware} --data {input.data} "
        "--selection {params.selection} --n-samples {params.samples} --seed {params.seed} "
        "--output {output.png} {output.pdf} 2> {log}"


rule parameter_errors:
    """The jackknife standard errors of one model of the grid (report.errors_method and errors_K, the figure
    seed) over the training split it was fitted to, every refit warm-started from it."""
    input:
        model=f"{fit_dir(ERRORS_METHOD, ERRORS_K, FIGURE_SEED)}/model.npz",
        train=f"{DATA}/train.parquet",
    output:
        json=f"{RESULTS}/tables/parameter_errors_K{ERRORS_K}.json",
        md=report(
            f"{RESULTS}/tables/parameter_errors_K{ERRORS_K}.md",
            caption="../report/parameter_errors.rst",
            category="Parameter errors",
        ),
    params:
        cli=CLI,
        folds=config["report"]["errors_folds"],
        max_iter=config["report"]["errors_max_iter"],
        seed=FIGURE_SEED,
    log:
        f"{RESULTS}/logs/report/parameter_errors.log",
    conda:
        ENV
    shell:
        "{params.cli} errors --model {input.model} --train {input.train} --n-folds {params.folds} "
        "--max-iter {params.max_iter} --seed {params.seed} --output-json {output.json} --output-md {output.md} "
        "2> {log}"

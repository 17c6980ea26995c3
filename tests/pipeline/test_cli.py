"""The command line turns every bad input into one clear error line and exit status 1, never a traceback."""

import json
import logging

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning

from scalable_xd.pipeline.cli import main


def _fit_args(files, **changes):
    args = {
        "--train": files / "data" / "train.parquet",
        "--val": files / "data" / "val.parquet",
        "--init": files / "init.npz",
        "--n-components": "3",
        "--method": "em",
        "--epochs": "1",
        "--output-model": files / "out" / "model.npz",
        "--output-metrics": files / "out" / "metrics.json",
    }
    args.update(changes)
    return ["fit"] + [str(item) for pair in args.items() for item in pair]


def _fails_with(argv, message, caplog):
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="scalable_xd"):
        assert main(argv) == 1
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1 and message in errors[0], errors


def test_a_raw_catalogue_where_features_are_expected(files, caplog):
    _fails_with(
        ["kmeans", "--train", str(files / "raw.parquet"), "--n-components", "3", "--output", str(files / "k.npz")],
        "is not a features file written by `scalable-xd features` (it looks like a raw catalogue: run "
        "`scalable-xd features` on it first)",
        caplog,
    )
    _fails_with(
        ["features", "--input", str(files / "data" / "train.parquet"), "--out-dir", str(files / "again")],
        "is not a raw Gaia catalogue: it lacks the columns ra, dec",
        caplog,
    )


@pytest.mark.parametrize("content", [b"not parquet at all", b"ra,dec\n1,2\n", b"PAR1"])
@pytest.mark.parametrize("step", ["kmeans", "fit"])
def test_a_file_that_is_not_parquet_is_named(files, caplog, content, step):
    """Garbage, a CSV or a truncated file where features are expected: named, not pyarrow's bare message."""
    bad = files / "not_features.parquet"
    bad.write_bytes(content)
    argv = ["kmeans", "--train", str(bad), "--n-components", "3", "--output", str(files / "k.npz")]
    if step == "fit":
        argv = _fit_args(files, **{"--train": bad})
    _fails_with(argv, f"{bad} is not a features file written by `scalable-xd features`: it is not a readable", caplog)


def test_wrong_columns_are_named_not_dumped(files, caplog):
    import pandas as pd

    pd.DataFrame({"a": [1.0]}).to_parquet(files / "wrong.parquet")
    _fails_with(
        ["kmeans", "--train", str(files / "wrong.parquet"), "--n-components", "3", "--output", str(files / "k.npz")],
        "wrong.parquet is not a features file written by `scalable-xd features` (no feature spec in its metadata, "
        "and columns a instead of x_<feature>)",
        caplog,
    )


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--n-components", "0"),
        ("--n-components", "-3"),
        ("--threads", "-4"),
        ("--epochs", "0"),
        ("--batch-size", "x"),
        ("--seed", "-1"),
    ],
)
def test_counts_out_of_range_are_refused_by_the_parser(files, flag, value, capsys):
    argv = {"--n-components": "3", "--output": str(files / "k.npz"), "--train": str(files / "data" / "train.parquet")}
    argv[flag] = value
    with pytest.raises(SystemExit) as exit_info:
        main(["kmeans"] + [item for pair in argv.items() for item in pair])
    assert exit_info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_missing_inputs_are_called_missing(files, caplog):
    _fails_with(_fit_args(files, **{"--init": files / "nothere.npz"}), "input file missing: ", caplog)
    _fails_with(_fit_args(files, **{"--init": files / "nothere.npz"}), "nothere.npz (--init)", caplog)


@pytest.mark.parametrize("content", ["keys", "pickle", "garbage"])
def test_bad_init_files_are_named(files, caplog, content):
    bad = files / f"bad_init_{content}.npz"
    if content == "keys":
        np.savez(bad, weights=np.ones(3) / 3)
    elif content == "pickle":
        np.savez(bad, weights=np.array([{}], dtype=object), means=np.zeros((3, 7)), seconds=1.0)
    else:
        bad.write_bytes(b"not an npz")
    message = {
        "keys": "it lacks means, seconds",
        "pickle": "it holds Python objects, which are never loaded",
        "garbage": "it is empty, truncated or of another format",
    }[content]
    _fails_with(
        _fit_args(files, **{"--init": bad}), f"{bad} is not an init file written by `scalable-xd kmeans`", caplog
    )
    _fails_with(_fit_args(files, **{"--init": bad}), message, caplog)


def test_a_corrupt_checkpoint_is_named(files, caplog):
    checkpoint = files / "corrupt.pt"
    checkpoint.write_bytes(b"\x00" * 100)
    _fails_with(
        _fit_args(files, **{"--checkpoint": checkpoint}), f"checkpoint {checkpoint} is empty, truncated", caplog
    )


def test_an_unwritable_output_fails_before_the_fit(files, caplog, monkeypatch):
    import scalable_xd.estimator

    (files / "a_file").write_text("x")
    monkeypatch.setattr(scalable_xd.estimator.XDGMM, "fit", None)  # the fit must not start
    _fails_with(
        _fit_args(files, **{"--output-model": files / "a_file" / "model.npz"}), "is not a writable directory", caplog
    )


def test_k_must_match_the_init_file(files, caplog):
    _fails_with(_fit_args(files, **{"--n-components": "4"}), "holds an init of K = 3 components, not 4", caplog)


def test_the_init_files_features_must_match_the_datas(files, caplog):
    other = files / "init_of_three_features.npz"
    np.savez(other, weights=np.ones(3) / 3, means=np.zeros((3, 3)), seconds=1.0)
    _fails_with(_fit_args(files, **{"--init": other}), f"{other} holds means of shape (3, 3), not (3, 7)", caplog)


def test_a_fit_without_validation_data(files):
    argv = _fit_args(files, **{"--output-metrics": files / "noval" / "metrics.json"})
    del argv[argv.index("--val") : argv.index("--val") + 2]
    assert main(["-q"] + argv) == 0
    from scalable_xd.pipeline.report.metrics import FitMetrics

    metrics = FitMetrics.read(files / "noval" / "metrics.json")
    assert metrics.val is None and metrics.history[-1]["val_loglik"] is None and metrics.test is None


@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_one_fit_command_fits_each_seed_as_a_fit_of_its_own(files, caplog, method):
    """Seeds fitted by one command (the data read once) are the fits each seed's own command gives, bit
    for bit (the same code on the same data), each with its own metrics. The minibatch methods fit the
    seeds after the first in lockstep: their metrics are timed at the first seed's pace, which they name.
    A seed without its own init or outputs is refused naming the counts."""
    from scalable_xd.pipeline.report.metrics import FitMetrics, epoch_seconds

    out = files / "seeds"
    seeds = ["3", "4", "5"]
    together = {"--method": method, "--epochs": "2", "--seed": seeds, "--init": [files / "init.npz"] * 3}
    together["--output-model"] = [out / f"m{seed}.npz" for seed in seeds]
    together["--output-metrics"] = [out / f"j{seed}.json" for seed in seeds]
    args = {"--train": files / "data" / "train.parquet", "--n-components": "3", **together}
    assert main(_argv(args)) == 0
    first = FitMetrics.read(out / "j3.json")
    for seed in seeds:
        alone = {**args, "--seed": seed, "--init": files / "init.npz"}
        alone.update({"--output-model": out / f"alone{seed}.npz", "--output-metrics": out / f"alone{seed}.json"})
        assert main(_argv(alone)) == 0
        one, two = FitMetrics.read(out / f"j{seed}.json"), FitMetrics.read(out / f"alone{seed}.json")
        assert one.seed == two.seed == int(seed)
        assert [h["train_loglik"] for h in one.history] == [h["train_loglik"] for h in two.history]
        assert np.array_equal(np.load(out / f"m{seed}.npz")["means"], np.load(out / f"alone{seed}.npz")["means"])
        assert one.warm_up_seconds > 0 and one.warm_up_seconds == first.warm_up_seconds  # once a job
        in_lockstep = method != "em" and seed != "3"
        assert one.timed_by == (3 if in_lockstep else None) and two.timed_by is None
        if in_lockstep:
            assert [h["seconds"] for h in one.history] == [e * epoch_seconds(first.history) for e in range(3)]
            assert one.wall_seconds is None
    _fails_with(
        _argv({**args, "--output-metrics": out / "j.json"}), "3 seeds but 3 --init, 3 --output-model, 1", caplog
    )


def _argv(args: dict) -> list[str]:
    """``scalable-xd -q fit`` with ``args`` (an option's values in a list where it takes several)."""
    values = lambda value: value if isinstance(value, list) else [value]  # noqa: E731
    return ["-q", "fit"] + [str(x) for key, value in args.items() for x in [key, *values(value)]]


def test_every_option_has_help_and_says_its_default():
    from scalable_xd.pipeline.cli import build_parser

    for name, sub in build_parser()._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if action.dest == "help":
                continue
            assert action.help, (name, action.dest)
            if not action.required and action.default not in (None, False) and action.dest != "run":
                assert "default" in action.help, (name, action.dest)


def test_foreign_inputs_to_the_report_steps_are_named_not_tracebacks(files, tmp_path, caplog):
    """A features file whose spec lacks its names, a features file given as a denoised catalogue, and a
    JSON that is not a calibration: one error line naming the file (KeyError and IndexError before)."""
    import json

    import pyarrow.parquet as pq

    table = pq.read_table(files / "data" / "val.parquet")
    meta = json.loads(table.schema.metadata[b"scalable_xd"])
    del meta["spec"]["names"]
    broken = table.replace_schema_metadata({b"scalable_xd": json.dumps(meta).encode()})
    pq.write_table(broken, tmp_path / "nameless.parquet")
    out = str(tmp_path / "k.npz")
    _fails_with(
        ["kmeans", "--train", str(tmp_path / "nameless.parquet"), "--n-components", "3", "--output", out],
        "nameless.parquet is not a features file written by `scalable-xd features`: its feature spec lacks names",
        caplog,
    )
    _fails_with(
        ["calibrate", "--denoised", str(files / "data" / "val.parquet"), "--output-json", out, "--output-md", out],
        "val.parquet is not a denoised catalogue (no mean_<feature> columns)",
        caplog,
    )
    (tmp_path / "other.json").write_text(json.dumps({"features": {}}))
    metrics = str(files / "data" / "features.json")
    _fails_with(
        [
            "claims",
            "--metrics",
            metrics,
            "--output",
            str(tmp_path / "c.md"),
            "--calibration",
            str(tmp_path / "other.json"),
        ],
        "other.json is not a calibration written by `scalable-xd calibrate` (no 'available' flag)",
        caplog,
    )


def test_every_help_page_renders_and_names_its_options(capsys):
    """``--help`` of the CLI and of each subcommand, as a user types it: formatted in full (argparse
    formats the help strings only then) and listing each option with its help text."""
    from scalable_xd.pipeline.cli import build_parser

    subcommands = build_parser()._subparsers._group_actions[0].choices
    for argv in [["--help"]] + [[name, "--help"] for name in subcommands]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0, argv
        page = capsys.readouterr().out
        assert page.startswith("usage: scalable-xd"), argv
        if len(argv) == 2:
            for action in subcommands[argv[0]]._actions:
                assert action.option_strings[-1] in page, (argv, action.dest)
    assert "90% of what converged XD achieves" in " ".join(_help_of("fit", capsys).split())
    synopsis = build_parser().description.split("DAG (see steps):")[1].split("\n\n")[1]
    said = set(synopsis.replace("/", " ").split())
    assert [name for name in subcommands if name not in said] == []  # every subcommand in the synopsis


def _help_of(subcommand: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([subcommand, "--help"])
    return capsys.readouterr().out


def test_a_table_of_fits_run_without_test_data(files, caplog):
    assert main(["-q"] + _fit_args(files)) == 0
    prefix = files / "tables" / "loglik"
    assert main(["-q", "table", "--metrics", str(files / "out" / "metrics.json"), "--output-prefix", str(prefix)]) == 0
    row = (prefix.with_suffix(".md")).read_text().splitlines()[4].split("|")  # after the caption and header
    assert row[4].strip() == "-"  # the test column: not measured
    _fails_with(
        ["table", "--metrics", str(files / "init.npz"), "--output-prefix", str(prefix)],
        "is not a metrics file written by `scalable-xd fit`",
        caplog,
    )


def test_help_answers_without_importing_torch_or_astropy():
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import contextlib, io, sys
        from scalable_xd.pipeline.cli import main
        with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
            main(["--help"])
        print(sorted(m for m in ("torch", "astropy", "pandas", "sklearn") if m in sys.modules))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_streamed_batch_em_fit_reports_what_the_in_memory_fit_reports(files):
    """Batch EM reads the rows in file order either way, so streaming changes only where the data live."""
    from scalable_xd.pipeline.report.metrics import FitMetrics

    runs = {}
    for name, extra in (("memory", {}), ("streamed", {"--stream-window": "500"})):
        argv = _fit_args(
            files,
            **{
                "--epochs": "3",
                "--dtype": "float64",
                "--test": files / "data" / "test.parquet",
                "--output-model": files / name / "model.npz",
                "--output-metrics": files / name / "metrics.json",
                **extra,
            },
        )
        assert main(["-q"] + argv) == 0
        runs[name] = FitMetrics.read(files / name / "metrics.json")
    memory, streamed = runs["memory"], runs["streamed"]
    for split in ("train", "val", "test"):
        got, want = getattr(streamed, split), getattr(memory, split)
        assert got["n"] == want["n"] and got["mean_missing_entries"] == want["mean_missing_entries"]
        assert got["loglik"] == pytest.approx(want["loglik"], rel=1e-12)
    assert streamed.true["test_true_loglik"] == pytest.approx(memory.true["test_true_loglik"], rel=1e-12)
    assert streamed.covariance_mode == memory.covariance_mode == "corrected"


def test_errors_writes_the_models_jackknife_as_json_and_a_table(files, tmp_path):
    model = tmp_path / "model.npz"
    fit = {"--output-model": model, "--output-metrics": tmp_path / "metrics.json", "--epochs": "30"}
    assert main(["-q"] + _fit_args(files, **fit)) == 0
    json_path, md_path = tmp_path / "errors.json", tmp_path / "errors.md"
    argv = ["errors", "--model", model, "--train", files / "data" / "train.parquet", "--n-folds", "4", "--seed", "2"]
    argv += ["--max-iter", "5"]  # the budget, not convergence, ends these refits: a check of the plumbing
    assert main(["-q"] + [str(a) for a in argv] + ["--output-json", str(json_path), "--output-md", str(md_path)]) == 0
    result = json.loads(json_path.read_text())
    from scalable_xd import XDGMM
    from scalable_xd.pipeline.features_file import read_features

    train = read_features(files / "data" / "train.parquet")
    with pytest.warns(ConvergenceWarning):
        errors = XDGMM.load(model).parameter_errors(
            train.X, Xcov=train.covariance(), n_folds=4, max_iter=5, random_state=2
        )
    heaviest = int(np.argmax(errors.centre.weights_))
    first = result["components"][0]
    assert first["component"] == heaviest and len(result["components"]) == 3
    np.testing.assert_allclose(first["mean_se"], errors.means[heaviest], rtol=1e-12)
    np.testing.assert_allclose(first["weight_se"], errors.weights[heaviest], rtol=1e-12)
    table = md_path.read_text().splitlines()
    assert table[2].startswith("| component | weight | mean ") and len(table) == 4 + 3
    assert f"| {heaviest} | {first['weight']:.4g} ± {first['weight_se']:.2g} |" in table[4]


def test_a_fit_logged_to_a_file_has_its_epoch_lines_and_no_progress_bars(files, capsys, caplog):
    """Progress bars only on a terminal: in a log (a workflow's), each would leave its first frame."""
    out = files / "bars"
    args = {"--train": files / "data" / "train.parquet", "--n-components": "3", "--method": "minibatch_em"}
    args.update({"--epochs": "2", "--init": files / "init.npz"})
    args.update({"--output-model": out / "m.npz", "--output-metrics": out / "j.json"})
    with caplog.at_level(logging.INFO, logger="scalable_xd.fit"):
        assert main(_argv(args)[1:]) == 0  # without -q
    assert any("epoch   2/2" in r.getMessage() for r in caplog.records)
    assert "batch" not in capsys.readouterr().err


def test_the_warm_up_compiles_every_kernel_a_selection_aware_fit_runs(files, monkeypatch):
    """The seeds' fits time no compile: a selection-aware fit's imputed points carry dense noise, a kernel of
    its own, which the warm-up left to the first fit's first epoch (42.6 s against 0.23 s in its log)."""
    import warnings
    from dataclasses import replace

    from scalable_xd import XDGMM
    from scalable_xd.kernel import fused
    from scalable_xd.pipeline import fit_steps
    from scalable_xd.pipeline.features_file import read_features
    from scalable_xd.settings import FitSettings

    split = read_features(files / "data" / "train.parquet")
    settings = FitSettings(method="em", epochs=2, tol=None, device="cpu", selection="phot_g_mean_mag < 20")
    modules = []
    compiled = fused.compiled_module
    monkeypatch.setattr(fused, "compiled_module", lambda *a, **k: modules.append(compiled(*a, **k)) or modules[-1])
    fit_steps._warm_up(settings, 3, split)
    warmed = {id(m): len(m.kernel.signatures) for m in modules}
    kept = split.subset(fit_steps.selected(split, settings))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = XDGMM(3, **replace(settings, selection=None).as_dict(), random_state=0)
        model.fit(kept.X, Xcov=kept.covariance(), selection=fit_steps._selection(settings, kept))
    assert modules and {id(m): len(m.kernel.signatures) for m in modules} == warmed

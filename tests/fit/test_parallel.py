"""Data-parallel fits: two gloo processes on this machine, started here as torchrun would start them, give
the one-process fit on the same global batches (float64, to summation order); a checkpoint written by two
processes resumes in one; a killed process makes the other fail with a message, not hang."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the worker
from parallel_worker import as_noise_mixture, problem  # noqa: E402

from scalable_xd import XDGMM

WORKER = Path(__file__).parents[1] / "parallel_worker.py"
BOX = "-8:12, -8:12, -8:12"  # a uniform background's box about the worker's data
BASE = dict(n_components=3, n_init=1, epochs=4, batch_size=100, tol=None, dtype="float64", device="cpu", random_state=3)

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(tmp_path, settings, checkpoint="", die_after=None, timeout=240, **environ):
    """Start ranks 0 and 1; return (rank 0's result file, the processes' return codes and stderr)."""
    output = tmp_path / "rank0.npz"
    env = {
        **os.environ,
        **environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "PYTHONPATH": str(Path(__file__).parents[2] / "src"),
    }
    args = [sys.executable, str(WORKER), str(output), json.dumps(settings), str(checkpoint)]
    args += [] if die_after is None else [str(die_after)]
    procs = [
        subprocess.Popen(
            args, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stderr=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    results = [(p.wait(timeout=timeout), p.stderr.read()) for p in procs]
    return output, results


@pytest.mark.parametrize(
    "method, options",
    [
        ("em", {}),
        ("minibatch_em", {}),
        ("sgd", {}),
        ("stochastic_minibatch_em", {}),
        ("minibatch_em", {"split_merge": True}),
        ("em", {"background": BOX, "acceleration": "none"}),
        ("minibatch_em", {"background": BOX}),
    ],
)
def test_two_processes_give_the_one_process_fit(tmp_path, method, options):
    settings = {**BASE, "method": method, **options}
    output, results = _run_two(tmp_path, settings)
    assert all(code == 0 for code, _ in results), results
    two = np.load(output)
    x, S = problem()
    one = XDGMM(**settings).fit(x, Xcov=S)
    for name in ("weights", "means", "covariances"):
        np.testing.assert_allclose(two[name], getattr(one, f"{name}_"), rtol=1e-9, atol=1e-12)
    history_two = json.loads(str(two["history"]))
    curve_two = [h["train_loglik"] for h in history_two]
    np.testing.assert_allclose(curve_two, [h["train_loglik"] for h in one.history_], rtol=1e-12)
    if "background" in options:  # the background's weight, from the reduced sums of its responsibilities
        weights_two = [h["background_weight"] for h in history_two[1:]]
        np.testing.assert_allclose(weights_two, [h["background_weight"] for h in one.history_[1:]], rtol=1e-9)


@pytest.mark.parametrize("method", ["em", "minibatch_em"])
def test_two_processes_with_noise_mixtures_give_the_one_process_fit(tmp_path, method):
    """Each process expands its share of a batch into noise components; the reduced sums are the
    one-process fit's, to summation order."""
    settings = {**BASE, "method": method}
    output, results = _run_two(tmp_path, settings, NOISE_MIXTURE="1")
    assert all(code == 0 for code, _ in results), results
    two = np.load(output)
    x, S = problem()
    one = XDGMM(**settings).fit(x, Xcov=as_noise_mixture(S))
    for name in ("weights", "means", "covariances"):
        np.testing.assert_allclose(two[name], getattr(one, f"{name}_"), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["em", "minibatch_em"])
def test_two_processes_under_a_selection_end_with_one_model(tmp_path, method):
    """Each process draws the removed points for its share of a batch (by seed, epoch, batch and rank), and
    the sums are reduced: every process holds the same model, in which the cluster at x_0 = 4 that the
    limit x_0 < 4 halves regains weight (1/3 in truth, 0.19 in a fit to the kept points; 0.25 after 30
    epochs in one process). (Not the one-process fit's model: that draws other points.)"""
    settings = {**BASE, "method": method, "tol": None, "acceleration": "none", "epochs": 30}
    output, results = _run_two(tmp_path, settings, SELECTION="4.0")
    assert all(code == 0 for code, _ in results), results
    zero, one = np.load(output), np.load(tmp_path / "rank1.npz")
    for name in ("weights", "means", "covariances"):
        assert np.array_equal(zero[name], one[name])
    halved = np.argmax(zero["means"][:, 0])
    assert zero["means"][halved, 0] > 3.3 and zero["weights"][halved] > 0.23


@pytest.mark.parametrize("given, differs", [("fewer rows", "rows, data"), ("other values", "data")])
def test_processes_given_different_data_fail_together_naming_it(tmp_path, given, differs):
    """Ranks with other data used to abort in gloo (other sizes) or return different models (same size)."""
    settings = {**BASE, "method": "minibatch_em"}
    _, results = _run_two(tmp_path, settings, timeout=120, RANK1_DATA=given)
    for rank, (code, err) in enumerate(results):
        assert code != 0, err
        assert f"rank {rank} of 2: the processes of this data-parallel fit were given different {differs} (" in err
    if given == "fewer rows":
        assert "rows: rank 0 2100, rank 1 2000" in results[0][1]


def test_bad_data_on_one_process_fails_every_process_naming_the_rank_and_row(tmp_path):
    """NaN on rank 1 failed rank 1 alone; rank 0 then lost contact (gloo's "Connection closed by peer")."""
    settings = {**BASE, "method": "minibatch_em"}
    _, results = _run_two(tmp_path, settings, timeout=120, RANK1_DATA="nan")
    for rank, (code, err) in enumerate(results):
        assert code != 0, err
        assert f"ValueError: rank {rank} of 2: checking the inputs failed on rank 1, so no process" in err, err
        assert "(rank 1: ValueError: X row 5, column 1 contains NaN or inf;" in err
        assert "lost contact" not in err


def test_a_damaged_checkpoint_on_one_process_fails_every_process_naming_it(tmp_path):
    """A file at rank 0's checkpoint path that is no checkpoint: rank 0 refused it and rank 1 lost contact."""
    settings = {**BASE, "method": "minibatch_em"}
    checkpoint = tmp_path / "fit.ckpt"
    checkpoint.write_bytes(b"not a checkpoint")
    _, results = _run_two(tmp_path, settings, checkpoint, timeout=120, RANK1_CHECKPOINT=str(tmp_path / "other"))
    for rank, (code, err) in enumerate(results):
        assert code != 0, err
        assert f"rank {rank} of 2: checking the checkpoint failed on rank 0, so no process" in err, err
        assert str(checkpoint) in err and "lost contact" not in err


def test_a_finished_checkpoint_on_one_process_only_fails_every_process_naming_it(tmp_path):
    """Rank 0 used to resume its finished fit and exit 0 while rank 1 started afresh and failed."""
    settings = {**BASE, "method": "minibatch_em"}
    checkpoint = tmp_path / "fit.ckpt"
    x, S = problem()
    XDGMM(**settings).fit(x, Xcov=S, checkpoint=checkpoint)
    _, results = _run_two(tmp_path, settings, checkpoint, timeout=120, RANK1_CHECKPOINT=str(tmp_path / "other"))
    for rank, (code, err) in enumerate(results):
        assert code != 0, err
        assert f"rank {rank} of 2: the processes of this data-parallel fit were given different checkpoint (" in err
        assert "rank 0 'epoch 4', rank 1 None" in err, err


@pytest.mark.parametrize(
    "environ, n_init, differs",
    [
        ({"RANK1_SETTINGS": '{"random_state": null}'}, 1, "random_state"),  # hung both processes before
        ({"RANK1_SETTINGS": '{"random_state": null}'}, 3, "random_state"),  # hung: one rank drew the starts' seed
        ({"RANK1_SETTINGS": '{"n_init": 3}'}, 1, "n_init"),  # rank 0 returned, rank 1 "lost contact"
        ({"RANK1_SETTINGS": '{"dtype": "float32"}'}, 1, "setting dtype"),  # was cut at 'epochs': 4...
        ({"RANK0_VAL": "1"}, 1, "validation data"),  # aborted rank 0 in gloo ("collective mismatch")
        ({"RANK0_EVAL": "1"}, 1, "eval_sets"),  # named "monitored sets", not by its parameter
    ],
)
def test_processes_given_different_settings_fail_together_naming_them(tmp_path, environ, n_init, differs):
    settings = {**BASE, "method": "minibatch_em", "n_init": n_init}
    _, results = _run_two(tmp_path, settings, timeout=120, **environ)
    for rank, (code, err) in enumerate(results):
        assert code != 0, err
        assert f"rank {rank} of 2: the processes of this data-parallel fit were given different {differs} (" in err


def test_the_command_line_states_the_group_timeout_the_library_uses():
    from scalable_xd.fit.run.parallel import GROUP_TIMEOUT
    from scalable_xd.pipeline.cli import build_parser

    fit = build_parser()._subparsers._group_actions[0].choices["fit"]
    assert next(a.default for a in fit._actions if a.dest == "group_timeout") == GROUP_TIMEOUT


def test_processes_without_a_random_state_share_rank_0s_seed(tmp_path):
    settings = {**BASE, "method": "minibatch_em", "random_state": None}
    _, results = _run_two(tmp_path, settings)
    assert all(code == 0 for code, _ in results), results


def test_a_checkpoint_of_two_processes_resumes_in_one(tmp_path):
    """Rank 1 is killed in epoch 3 (21 batches an epoch); rank 0 wrote the checkpoint of epoch 2."""
    settings = {**BASE, "method": "minibatch_em"}
    checkpoint = tmp_path / "fit.ckpt"
    _, results = _run_two(tmp_path, settings, checkpoint, die_after=2 * 21 + 5)
    assert [code != 0 for code, _ in results] == [True, True] and checkpoint.exists()
    x, S = problem()
    resumed = XDGMM(**settings).fit(x, Xcov=S, checkpoint=checkpoint)
    uninterrupted = XDGMM(**settings).fit(x, Xcov=S)
    assert [h["epoch"] for h in resumed.history_] == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(resumed.means_, uninterrupted.means_, rtol=1e-9)


def test_a_killed_process_makes_the_other_fail_with_a_message(tmp_path):
    tick = time.perf_counter()
    _, results = _run_two(tmp_path, {**BASE, "method": "minibatch_em"}, die_after=5, timeout=120)
    (code0, err0), (code1, _) = results
    assert code1 == 3 and code0 != 0
    assert "rank 0 of 2: lost contact with the other processes" in err0
    assert "the group's timeout, 60 s" in err0  # the worker's own group: its timeout read from the group
    assert time.perf_counter() - tick < 100  # well inside the group's 60 s timeout plus start-up


def _fit_args(files, out, method, *extra):
    return [
        "-q",
        "fit",
        "--train",
        str(files / "data" / "train.parquet"),
        "--init",
        str(files / "init.npz"),
        "--n-components",
        "3",
        "--method",
        method,
        "--epochs",
        "2",
        "--dtype",
        "float64",
        "--device",
        "cpu",
        "--output-model",
        str(out / "model.npz"),
        "--output-metrics",
        str(out / "metrics.json"),
        *extra,
    ]


def _same_model(one, two):
    np.testing.assert_allclose(XDGMM.load(two / "model.npz").means_, XDGMM.load(one / "model.npz").means_, rtol=1e-9)


ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}


@pytest.mark.parametrize("stream", [[], ["--stream-window", "700"]])
def test_torchrun_runs_the_command_line_fit(files, tmp_path, stream):
    """`torchrun --nproc-per-node 2 -m scalable_xd fit ...` gives the model of the one-process command, with
    the data in memory or streamed from disk (each process reading every window)."""
    from scalable_xd.pipeline.cli import main

    assert main(_fit_args(files, tmp_path / "one", "minibatch_em", *stream)) == 0
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "scalable_xd",
    ]
    done = subprocess.run(
        torchrun + _fit_args(files, tmp_path / "two", "minibatch_em", *stream),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _same_model(tmp_path / "one", tmp_path / "two")
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["metrics.json", "model.npz"]


def test_a_features_file_one_rank_cannot_read_fails_every_rank_naming_the_rank_and_the_file(files, tmp_path):
    """Rank 1 reads the training file as a damaged one (pyarrow's error for a file whose footer is gone, as
    a node's copy of it might be): it used to exit alone naming the file, and rank 0 to report a lost
    contact; now every rank says which rank failed and why."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import pyarrow, pyarrow.parquet as pq\n"
        "    def damaged(*args, **kwargs):\n"
        "        raise pyarrow.ArrowInvalid('Parquet magic bytes not found in footer. Either the file is corrupted')\n"
        "    pq.read_schema = damaged\n"
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*torchrun, "-m", "scalable_xd", *_fit_args(files, tmp_path / "two", "minibatch_em")],
        env={**ENV, "PYTHONPATH": f"{site}{os.pathsep}{ENV['PYTHONPATH']}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    train = str(files / "data" / "train.parquet")
    for rank in (0, 1):
        said = f"rank {rank} of 2: reading the features files failed on rank 1, so no process"
        assert said in done.stderr, done.stderr[-3000:]
    assert f"(rank 1: ValueError: {train}" in done.stderr or train in done.stderr.split("(rank 1:")[1]
    assert "lost contact" not in done.stderr and not (tmp_path / "two" / "model.npz").exists()


def test_two_nodes_meet_at_a_rendezvous_as_srun_would_start_them(files, tmp_path):
    """Two torchrun agents, as `srun --ntasks-per-node 1` starts one per node of a multi-node fit
    (fit.nodes), meet at a c10d rendezvous and give the one-process fit."""
    from scalable_xd.pipeline.cli import main

    assert main(_fit_args(files, tmp_path / "one", "sgd")) == 0
    agent = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--rdzv-id",
        "xd",
        "-m",
        "scalable_xd",
    ] + _fit_args(files, tmp_path / "two", "sgd")
    nodes = [subprocess.Popen(agent, env=ENV, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(node.wait(timeout=300), node.stderr.read()) for node in nodes]
    assert all(code == 0 for code, _ in results), [err[-2000:] for _, err in results]
    _same_model(tmp_path / "one", tmp_path / "two")


def test_a_process_that_failed_alone_says_why_even_when_the_others_are_gone(monkeypatch):
    """Its own error, not a lost contact, where the exchange that would share it finds no one."""
    from scalable_xd.fit.run import parallel

    def gone(out, mine):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(parallel.dist, "all_gather_object", gone)
    with pytest.raises(ValueError, match="X row 5, column 1 contains NaN"):
        with parallel.fail_together(parallel.Group(1, 2), "checking the inputs"):
            raise ValueError("X row 5, column 1 contains NaN or inf")
    with pytest.raises(RuntimeError, match="rank 1 of 2: lost contact with the other processes"):
        with parallel.fail_together(parallel.Group(1, 2), "checking the inputs"):
            pass

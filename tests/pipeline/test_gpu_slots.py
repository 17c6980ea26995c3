"""Concurrent command-line jobs on a machine with several GPUs each get a GPU of their own.

No GPU is needed: the jobs are real processes that claim real lock files, with torch told that CUDA has
``n_gpus`` devices; each reports the device it was told to use."""

import os
import subprocess
import sys

import pytest
import torch

from scalable_xd.pipeline import gpu_slots
from scalable_xd.pipeline.cli import main

pytestmark = pytest.mark.slow  # concurrent processes that wait on one another

JOB = """
import sys, time, pathlib, torch
from scalable_xd.pipeline import gpu_slots
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: int(sys.argv[1])
gpu_slots.slot_folder = lambda: pathlib.Path(sys.argv[2])
print(gpu_slots.job_device(sys.argv[3]), flush=True)
release = pathlib.Path(sys.argv[2]) / "release"
while not release.exists():
    time.sleep(0.05)
"""


def _run_jobs(tmp_path, n_jobs: int, n_gpus: int, requested: str = "cuda") -> list[str]:
    """Start ``n_jobs`` jobs at once, collect the device each reports while all are alive, let them exit."""
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", JOB, str(n_gpus), str(tmp_path), requested], stdout=subprocess.PIPE, text=True
        )
        for _ in range(n_jobs)
    ]
    try:
        return sorted(job.stdout.readline().strip() for job in jobs)
    finally:
        (tmp_path / "release").touch()
        for job in jobs:
            assert job.wait(timeout=60) == 0


def test_concurrent_jobs_get_different_gpus(tmp_path):
    assert _run_jobs(tmp_path, 3, n_gpus=3) == ["cuda:0", "cuda:1", "cuda:2"]


def test_more_jobs_than_gpus_spread_evenly(tmp_path):
    assert _run_jobs(tmp_path, 5, n_gpus=2) == ["cuda:0", "cuda:0", "cuda:0", "cuda:1", "cuda:1"]


def test_a_finished_job_frees_its_gpu(tmp_path):
    assert _run_jobs(tmp_path, 2, n_gpus=2) == ["cuda:0", "cuda:1"]
    (tmp_path / "release").unlink()
    assert _run_jobs(tmp_path, 1, n_gpus=2) == ["cuda:0"]


def test_a_named_gpu_one_gpu_and_torchrun_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(gpu_slots, "slot_folder", lambda: pytest.fail("no slot should be claimed"))
    assert gpu_slots.job_device("cuda:2") == "cuda:2"
    assert gpu_slots.job_device("cpu") == "cpu"
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun: cuda:LOCAL_RANK, chosen by the process group
    assert gpu_slots.job_device("cuda") == "cuda"
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpu_slots.job_device("auto") == "auto"


def test_the_command_line_runs_each_job_on_the_device_it_was_given(files, monkeypatch):
    """The CLI hands every subcommand with --device the device ``job_device`` chose."""
    import scalable_xd.pipeline.cli as cli
    import scalable_xd.pipeline.steps as steps

    asked, used = [], []
    monkeypatch.setattr(cli, "job_device", lambda device: asked.append(device) or "cpu")
    kmeans = steps.kmeans
    monkeypatch.setattr(steps, "kmeans", lambda *args, **kw: used.append(args[4]) or kmeans(*args, **kw))
    out = files / "slot" / "init.npz"
    assert (
        main(
            [
                "-q",
                "kmeans",
                "--train",
                str(files / "data" / "train.parquet"),
                "--n-components",
                "3",
                "--device",
                "cuda",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert asked == ["cuda"] and used == ["cpu"] and out.exists()


def test_slot_folders_are_per_user_and_per_set_of_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    first = gpu_slots.slot_folder()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpu_slots.slot_folder() != first
    assert str(os.getuid()) in first.name

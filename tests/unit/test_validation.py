"""Malformed configurations fail with one clear line before any process starts.

``config.validate`` is checked case by case (fast, in process); the CLI path (one line
``error: ...``, exit status 2, nothing run) is checked once for the cases added with the
checkpoint/fault sections and for unknown config-group names, through ``cli.main`` in process
(as real ``python run.py`` processes with ``-m slow``; tests/integration/test_cli.py covers the rest of the
CLI mechanism).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys

import pytest

from tests import REPO
from zero_repro import config as C
from zero_repro import validation


CASES = {
    "tp_heads": ({"model.n_embd": 96, "model.n_head": 12, "parallel.tp": 5,
                  "parallel.world_size": 10}, "parallel.tp=5 does not divide model.n_head=12"),
    # tp | n_head and n_head | n_embd imply tp | n_embd: the hidden-size case is this one
    "heads_hidden": ({"model.n_embd": 50, "model.n_head": 4},
                     "model.n_embd=50 is not divisible by model.n_head=4"),
    "world": ({"parallel.world_size": 3, "parallel.tp": 2},
              "parallel.world_size=3 is not divisible by parallel.tp=2"),
    "bucket0": ({"zero.reduce_bucket_size": 0}, "zero.reduce_bucket_size=0 must be a positive"),
    "bucket_neg": ({"zero.allgather_bucket_size": -5},
                   "zero.allgather_bucket_size=-5 must be a positive"),
    "stage": ({"zero.stage": 4}, "zero.stage=4 is not one of [0, 1, 2, 3]"),
    "dtype": ({"zero.dtype": "fp8"}, "zero.dtype='fp8' is not one of"),
    "zero_r": ({"zero_r.name": "c9"}, "zero_r.name='c9' is not one of"),
    "pa_without_ckpt": ({"zero_r.partition_activations": True},
                        "need zero_r.activation_checkpointing=true"),
    "cpu_without_pa": ({"zero_r.activation_checkpointing": True,
                        "zero_r.cpu_checkpointing": True}, "needs zero_r.partition_activations"),
    "nccl_on_cpu": ({"cluster.backend": "nccl"}, "cluster.backend=nccl needs cluster.device=cuda"),
    "warmup": ({"train.steps": 3, "train.warmup_steps": 3}, "train.warmup_steps=3 must be"),
    "timeout": ({"launcher.collective_timeout_s": 0}, "launcher.collective_timeout_s=0 must"),
    "save_every": ({"checkpoint.save_every": -1}, "checkpoint.save_every=-1 must be >= 0"),
    "keep": ({"checkpoint.keep": -2}, "checkpoint.keep=-2 must be >= 0"),
    "resume_missing": ({"checkpoint.resume": "/nonexistent/step_00000002"},
                       "checkpoint.resume='/nonexistent/step_00000002' does not exist"),
    "fault_rank": ({"fault.rank": 5}, "fault.rank=5 is not a rank of parallel.world_size=2"),
    "fault_step": ({"fault.rank": 0, "fault.step": 99}, "fault.step=99 never happens"),
    "fault_mode": ({"fault.mode": "explode"}, "fault.mode='explode' is not one of"),
}


def _config(overrides: dict) -> C.Config:
    cfg = C.Config()
    for dotted, value in overrides.items():
        sec, key = dotted.split(".")
        setattr(getattr(cfg, sec), key, value)
    return cfg


@pytest.mark.parametrize("case", sorted(CASES))
def test_validate_rejects_with_one_clear_line(case):
    overrides, message = CASES[case]
    with pytest.raises(ValueError) as e:
        validation.validate(_config(overrides))
    text = str(e.value)
    assert message in text and "\n" not in text, text


def test_valid_defaults_and_resume_modes_pass(tmp_path):
    validation.validate(C.Config())
    for how in ("", "auto", "latest"):
        validation.validate(_config({"checkpoint.resume": how}))
    (tmp_path / "manifest.json").write_text("{}")
    validation.validate(_config({"checkpoint.resume": str(tmp_path)}))  # a checkpoint directory


def test_resume_latest_without_checkpoint_fails_before_spawning(tmp_path):
    from zero_repro.lab.launcher import run_training

    cfg = validation.validate(_config({"checkpoint.resume": "latest"}))
    with pytest.raises(ValueError, match="checkpoint.resume=latest but .* holds no committed"):
        run_training(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # nothing was started or written


# the command lines of the cases added with the checkpoint/fault sections and for unknown
# config-group names, with the line each must print
CLI_CASES = [(["model=gpt_nosuch"], "unknown model 'gpt_nosuch'"),
             (["cluster=dgx9"], "unknown cluster 'dgx9'"),
             (["checkpoint.resume=/nonexistent/ck"], "checkpoint.resume='/nonexistent/ck'"),
             (["fault.rank=7"], "fault.rank=7 is not a rank")]


def test_cli_entry_refuses_the_new_cases_with_one_line_and_exit_2(tmp_path, monkeypatch,
                                                                   capsys):
    """The same command lines through the CLI's entry point (``cli.main``) in this process,
    nothing allowed to start: exit status 2, one ``error:`` line naming the case, nothing
    written. That the real ``python run.py`` prints only that line and exits 2 is proven in
    tests/integration/test_bad_inputs.py (``test_real_cli_prints_one_error_line_and_exits_2``); these four
    as real processes: ``test_cli_new_cases_are_one_line_usage_errors`` (``-m slow``)."""
    from zero_repro.lab import cli
    from zero_repro.runtime.comm import launch

    def refuse(*a, **k):
        raise AssertionError("a process was started for a bad input")

    for owner, name in [(launch, "spawn"), (subprocess, "run"), (subprocess, "Popen")]:
        monkeypatch.setattr(owner, name, refuse)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    results = tmp_path / "results"
    try:
        for i, (args, message) in enumerate(CLI_CASES):
            monkeypatch.setattr(sys, "argv", [
                "run.py", "+exp=smoke", *args, f"experiment.results_dir={results}",
                f"hydra.run.dir={tmp_path / 'hydra' / str(i)}"])
            with pytest.raises(SystemExit) as e:
                cli.main()
            err = capsys.readouterr().err
            lines = err.strip().splitlines()
            assert e.value.code == 2, (args, e.value.code, err[-1500:])
            assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
                (args, err[-1500:])
            assert not results.exists()
    finally:
        for s, h in handlers.items():  # cli.main installs its own
            signal.signal(s, h)
        cli._signalled.clear()


@pytest.mark.slow
def test_cli_new_cases_are_one_line_usage_errors(tmp_path):
    """The four command lines above as real ``python run.py`` processes (in the default suite:
    ``test_cli_entry_refuses_the_new_cases_with_one_line_and_exit_2`` in process, and
    tests/integration/test_bad_inputs.py's real-CLI test for the process's one line and exit status)."""
    results = tmp_path / "results"
    cases = CLI_CASES
    def one(i):  # each its own Hydra run directory: two run at once
        return subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "+exp=smoke",
                               *cases[i][0], f"experiment.results_dir={results}",
                               f"hydra.run.dir={tmp_path / 'hydra' / str(i)}"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    with cf.ThreadPoolExecutor(2) as pool:  # two CLI starts at a time (2 cores)
        runs = list(pool.map(one, range(len(cases))))
    for (args, message), p in zip(cases, runs):
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2, (args, p.returncode, p.stderr[-1500:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
            (args, p.stderr[-1500:])
        assert not results.exists()

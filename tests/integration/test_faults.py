"""Failure paths end to end: a rank killed mid-step through the CLI, a rank that raises, a rank
that hangs (peers time out), and a preempted run resumed from its checkpoint.

Each case must end every process within a bounded time, name the failing rank, and give a
non-zero exit status (CLI) or ``WorkerFailed`` (library). Fault injection is the ``fault.*``
config section (``lab.rank.inject_fault``): the rank fails after backward, before the optimizer
step, i.e. while its peers are inside that step's collectives.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from tests import REPO
from zero_repro import config as C
from zero_repro import validation
from zero_repro.runtime.comm.launch import WorkerFailed
from zero_repro.lab.launcher import run_training



def _tagged_processes(tag: str) -> list[int]:
    """Our processes (any depth, orphans included) whose environment carries ``tag``."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("ZR_TEST_TAG") == tag:
                found.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return found


def test_cli_rank_killed_mid_step_exits_nonzero_naming_it(tmp_path):
    tag = uuid.uuid4().hex
    env = dict(os.environ, ZR_TEST_TAG=tag)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "+exp=smoke",
                        "parallel.tp=1", "train.steps=4", "train.warmup_steps=1",
                        "train.progress=false", "fault.rank=1", "fault.step=2",
                        "launcher.collective_timeout_s=20",
                        f"experiment.results_dir={tmp_path}",
                        f"hydra.run.dir={tmp_path / 'hydra'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=90, env=env)
    elapsed = time.monotonic() - t0
    assert p.returncode == 1, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert elapsed < 60, f"took {elapsed:.0f}s"
    assert "failed" in p.stdout and "rank 1 failed" in p.stdout, p.stdout[-2000:]
    assert "code 9" in p.stdout  # the kill, not the peer's lost connection, is reported
    time.sleep(0.5)
    assert _tagged_processes(tag) == [], "worker processes outlived the CLI"
    rec = json.loads((tmp_path / "smoke" / "points.jsonl").read_text().splitlines()[-1])
    assert rec["status"] == "failed" and "rank 1" in rec["reason"]


def _cfg(tmp_path, **over) -> C.Config:
    cfg = C.Config()
    cfg.model = C.ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=128,
                              vocab_pad_multiple=8)
    cfg.parallel.world_size, cfg.parallel.tp = 2, 1
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.progress = 4, 1, False
    cfg.train.micro_batch_size = 2
    cfg.launcher.collective_timeout_s = 5.0
    for dotted, v in over.items():
        sec, key = dotted.split("__")
        setattr(getattr(cfg, sec), key, v)
    return validation.validate(cfg)


# "raise" is also covered at the spawn level by tests/unit/test_data_launch.py: slow here
@pytest.mark.parametrize("mode", [pytest.param("raise", marks=pytest.mark.slow), "hang"])
def test_raise_or_hang_ends_all_ranks_in_bounded_time(tmp_path, mode):
    cfg = _cfg(tmp_path, fault__rank=1, fault__step=1, fault__mode=mode)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as e:
        run_training(cfg, str(tmp_path / mode))
    elapsed = time.monotonic() - t0
    if mode == "raise":
        assert e.value.rank == 1 and "fault injection: rank 1 raised" in str(e.value)
        assert elapsed < 30
    else:  # rank 0 times out in the step's collective (5 s): the headline names rank 1, hung
        assert e.value.rank == 1 and "hung: ranks [1] made no progress" in str(e.value), e.value
        assert "ranks [0] timed out waiting" in str(e.value)
        # the hung rank never returns: bounded at all means the timeout fired (slack for load)
        assert elapsed < 90, f"the collective timeout did not fire ({elapsed:.0f}s)"


@pytest.mark.slow
def test_preempted_run_resumes_on_another_stage_with_same_trajectory(tmp_path):
    """Uninterrupted stage-1 run vs. a run killed after its step-2 checkpoint and resumed at
    stage 3 (same 2 ranks): the losses of steps 2 and 3 agree."""
    full = run_training(_cfg(tmp_path, zero__stage=1), str(tmp_path / "full"))
    run_dir = str(tmp_path / "pre")
    with pytest.raises(WorkerFailed):  # preempted: rank 0 dies at step 3, after saving step 2
        run_training(_cfg(tmp_path, zero__stage=1, checkpoint__save_every=2, fault__rank=0,
                          fault__step=3), run_dir)
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "latest"))
    resumed = run_training(_cfg(tmp_path, zero__stage=3, checkpoint__resume="latest"), run_dir)
    m, f = resumed["metrics"], full["metrics"]
    assert m["start_step"] == 2 and m["resumed_from"].endswith("step_00000002")
    assert m["losses"] == pytest.approx(f["losses"][2:], abs=1e-6)

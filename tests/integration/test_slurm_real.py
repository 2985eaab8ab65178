"""launcher=slurm against a REAL Slurm cluster (marker ``slurm``): every path end to end.

Needs a running cluster whose clients find it (``SLURM_CONF``), with accounting (``sacct``):
``bash .ci/slurm_cluster.sh start`` + ``eval "$(bash .ci/slurm_cluster.sh env)"`` gives a
single-node one (what ``.ci/run`` does). Without a cluster every test here is skipped with that
hint; with ``ZR_SLURM_REQUIRED=1`` (set by ``.ci/run`` once it started one) they fail instead.

The points are the smoke experiment's tiny GPT (2 CPU ranks, TP 2, gloo) run through the real
CLI (``python run.py``), submitit, sbatch, srun and the worker; only the step counts differ.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests import REPO
from zero_repro import config as C
from zero_repro import schema
from zero_repro import validation
from zero_repro.lab import records as R

pytestmark = pytest.mark.slurm

START_HINT = ('no Slurm cluster is up: start one with `bash .ci/slurm_cluster.sh start` and '
              '`eval "$(bash .ci/slurm_cluster.sh env)"` (root, Debian), then re-run')
POINT = ["+exp=smoke", "launcher=slurm", "train.data=synthetic", "train.progress=false",
         "train.warmup_steps=1"]


def last_line(text: str) -> str:
    """A probe's stderr in one line: its last non-empty one (Slurm's clients print the cause's
    chain, e.g. four lines ending in ``fatal: Could not establish a configuration source``)."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no output"


def _cluster_problem() -> str:
    """Why no cluster can be used here ('' if one answers with an idle/usable node)."""
    missing = [c for c in ("sbatch", "srun", "sacct", "scontrol", "squeue", "scancel", "sinfo")
               if shutil.which(c) is None]
    if missing:
        return f"Slurm commands not installed ({', '.join(missing)})"
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                           timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if p.returncode != 0:
        return f"sinfo failed: {last_line(p.stderr)}"
    if not re.search(r"^(idle|mixed|allocated)", p.stdout, re.M):
        return f"no usable node (sinfo: {p.stdout.strip()!r})"
    if subprocess.run(["sacct", "-n", "-X", "-S", "now"], capture_output=True,
                      timeout=20).returncode != 0:
        return "sacct does not work (the cluster needs accounting: slurmdbd)"
    return ""


@pytest.fixture(scope="module")
def cluster():
    why = _cluster_problem()
    if why:
        if os.environ.get("ZR_SLURM_REQUIRED") == "1":
            pytest.fail(f"ZR_SLURM_REQUIRED=1 but {why}")
        pytest.skip(f"{START_HINT} ({why})")
    return True


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
             WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    for k in [k for k in e if (k.startswith("SLURM_") and k != "SLURM_CONF")
              or k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")]:
        del e[k]  # as on a login node, also when pytest itself runs inside a job
    return e


def cli(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(REPO, "run.py"), *args], cwd=REPO,
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kw)


def finish(p: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"timed out after {timeout}s:\n{out[-4000:]}")
    return out


def records(results: str) -> list[R.Record]:
    return R.RecordStore.for_experiment(results, "smoke").load()


def sacct_state(job: str) -> str:
    for _ in range(20):  # sacct lags a second or two behind the controller
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"],
                             capture_output=True, text=True).stdout.split()
        if out and out[0] not in ("RUNNING", "PENDING", "COMPLETING"):
            return out[0]
        time.sleep(0.5)
    return out[0] if out else ""


def running_job(results: str, timeout: float = 120) -> str:
    """Id of the (only) job submitted for ``results`` once its ranks are training."""
    end = time.monotonic() + timeout
    root = os.path.join(results, "smoke", "runs", "submitit")
    while time.monotonic() < end:
        for job in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            err = os.path.join(root, job, f"{job}_0_log.err")
            if os.path.exists(err) and "launching: srun" in open(err).read():
                time.sleep(5)  # the ranks are up and training
                return job
        time.sleep(0.5)
    pytest.fail(f"no job started training within {timeout}s ({root})")


@pytest.fixture(scope="module")
def smoke(cluster, tmp_path_factory):
    results = str(tmp_path_factory.mktemp("smoke"))
    t0 = time.monotonic()
    out = finish(cli([*POINT, "train.steps=4", f"experiment.results_dir={results}",
                      f"hydra.run.dir={results}/hydra"]), 300)
    return results, out, time.monotonic() - t0


def test_smoke_point_recorded_ok_with_job_id(smoke):
    results, out, _ = smoke
    (rec,) = records(results)
    assert rec.status == "ok", (rec.reason, out[-3000:])
    job = rec.hardware.get("slurm_job_id", "")
    assert job.isdigit(), rec.hardware
    assert re.search(rf"-> Slurm job {job} ", out)
    assert sacct_state(job) == "COMPLETED"
    assert len(rec.metrics["losses"]) == 4 and rec.metrics["loss_last"] < rec.metrics["loss_first"]


def test_time_limit_signal_arrives_during_training_and_point_still_ok(smoke, tmp_path):
    """Slurm warns with SIGUSR2 ``signal_delay_s`` before the limit. It checks limits every
    30 s (and sends the warning up to 30 s early), so with a 5-minute limit and a 255 s delay
    the signal comes 15-45 s after the start (measured: 23 s). The point trains for ~75 s
    planned from the smoke point's fastest step, must see the signal and end ok. The plan is
    rough: the smoke point logs a line per step, this one every 1000 (its real steps measured
    0.55x the smoke point's median: a planned 55 s trained ~30 s and once ended before the
    signal; from the fastest step 100 s planned trained 115 s), so 0.7x leaves ~52 s of training
    after a start of ~8 s, and a machine loaded 2x ends at ~160 s, inside the limit."""
    (first,) = records(smoke[0])
    step_s = max(min(first.metrics["step_times_s"]), 0.002)
    steps = int(min(max(75.0 / step_s, 50), 50000))
    results = str(tmp_path)
    out = finish(cli([*POINT, f"train.steps={steps}", "train.log_every=1000",
                      "launcher.timeout_min=5",
                      "launcher.signal_delay_s=255", f"experiment.results_dir={results}",
                      f"hydra.run.dir={results}/hydra"]), 420)
    (rec,) = records(results)
    assert rec.status == "ok", (rec.reason, out[-3000:])
    got = rec.metrics.get("signals") or []
    assert got and got[0]["signal"] == "SIGUSR2", (
        f"no SIGUSR2 reached the ranks during {steps} steps (~{steps * step_s:.0f}s); "
        f"training ended too early to show the fix")
    assert len(rec.metrics["losses"]) == steps
    assert "#SBATCH --signal=USR2@255" in open(
        os.path.join(results, "smoke", "runs", "submitit", rec.hardware["slurm_job_id"],
                     f"{rec.hardware['slurm_job_id']}_submission.sh")).read()
    assert sacct_state(rec.hardware["slurm_job_id"]) == "COMPLETED"


def test_scancel_is_recorded_cancelled(cluster, tmp_path):
    results = str(tmp_path)
    p = cli([*POINT, "train.steps=1000000", "launcher.timeout_min=10",
             f"experiment.results_dir={results}", f"hydra.run.dir={results}/hydra"])
    job = running_job(results)
    subprocess.run(["scancel", job], check=True)
    out = finish(p, 120)
    (rec,) = records(results)
    assert rec.status == "cancelled", (rec.reason, out[-3000:])
    assert f"Slurm job {job} ended CANCELLED" in rec.reason
    assert f"{job}_0_log.err" in rec.reason  # the log's path is quoted
    assert p.returncode == 1  # a cancelled point is not done


def test_hard_killed_job_is_recorded_failed_within_60s(cluster, tmp_path):
    results = str(tmp_path)
    p = cli([*POINT, "train.steps=1000000", "launcher.timeout_min=10",
             f"experiment.results_dir={results}", f"hydra.run.dir={results}/hydra"])
    job = running_job(results)
    # the job's own process (submitit's runner in the batch step), killed like the OOM killer
    # would: nothing in the job gets to write a record
    pids = subprocess.run(["scontrol", "listpids", job], capture_output=True, text=True,
                          check=True).stdout
    batch = [int(ln.split()[0]) for ln in pids.splitlines()[1:]
             if ln.split()[2:3] == ["batch"] and "submitit" in _cmdline(int(ln.split()[0]))]
    assert batch, pids
    t_kill = time.monotonic()
    os.kill(batch[0], signal.SIGKILL)
    out = finish(p, 90)
    took = time.monotonic() - t_kill
    (rec,) = records(results)
    assert rec.status == "failed", (rec.reason, out[-3000:])
    assert f"Slurm job {job} ended FAILED" in rec.reason and f"{job}_0_log" in rec.reason
    assert took < 60, f"recorded {took:.0f}s after the kill"


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


def test_multirun_submitit_slurm_with_launcher_slurm(cluster, tmp_path):
    """Hydra's submitit_slurm runs each override combination as a job whose task runs under
    srun; launcher=slurm then runs the point in that allocation and its own srun must share the
    task's CPUs (--overlap), or it waits forever."""
    results = str(tmp_path / "results")
    out = finish(cli(["--multirun", "hydra/launcher=submitit_slurm", *POINT, "train.steps=3",
                      "train.seed=1,2", f"experiment.results_dir={results}",
                      f"hydra.sweep.dir={tmp_path}/multirun", "hydra.launcher.timeout_min=10",
                      "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=2"]), 420)
    recs = records(results)
    assert len(recs) == 2 and all(r.status == "ok" for r in recs), ([r.reason for r in recs],
                                                                  out[-3000:])
    assert sorted(r.config["train"]["seed"] for r in recs) == [1, 2]
    jobs = {r.hardware["slurm_job_id"] for r in recs}
    assert len(jobs) == 2 and all(sacct_state(j) == "COMPLETED" for j in jobs)


def test_sbatch_template_with_cpu_overrides(cluster, tmp_path):
    """plan -> point file + printed `sbatch ... slurm/<template> FILE` hint -> run that line."""
    results = str(tmp_path / "results")
    out = finish(cli([*POINT, "train.steps=3", "experiment.action=plan",
                      f"experiment.results_dir={results}", f"hydra.run.dir={tmp_path}/plan"]), 120)
    (hint,) = [ln.split("point file: ", 1)[1] for ln in out.splitlines() if "point file: " in ln]
    assert "--gpus-per-node=0" in hint and re.search(r" slurm/\w+\.sbatch ", hint), hint
    template = hint.split()[-2]
    assert os.path.exists(os.path.join(REPO, template))
    cmd = hint.split()
    cmd[1:1] = ["--wait", "--time=5", f"--output={tmp_path}/slurm-%j.out"]
    p = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    job = re.search(r"Submitted batch job (\d+)", p.stdout)[1]
    (rec,) = records(results)
    assert rec.status == "ok", (rec.reason, open(f"{tmp_path}/slurm-{job}.out").read()[-3000:])
    assert p.returncode == 0 and rec.hardware["slurm_job_id"] == job
    assert rec.sweep_id == "plan" and sacct_state(job) == "COMPLETED"


def test_torchrun_under_srun_recipe(cluster, tmp_path):
    """slurm/README.md's torchrun recipe, as written there, inside an sbatch job."""
    readme = open(os.path.join(REPO, "slurm", "README.md")).read()
    recipe = re.search(r"# torchrun-under-srun recipe\n(.*?)\n```", readme, re.S)[1]
    cfg = C.Config()
    cfg.model = C.ModelConfig(name="tiny", n_layer=2, n_embd=64, n_head=4, seq_len=64,
                              vocab_size=512, vocab_pad_multiple=8)
    cfg.parallel.world_size, cfg.parallel.tp = 2, 2
    cfg.train.steps, cfg.train.progress, cfg.train.micro_batch_size = 3, False, 2
    cfg.launcher = C.LauncherConfig(name="torchrun")
    schema.save(validation.validate(cfg), str(tmp_path / "resolved.yaml"))
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nset -euo pipefail\n"
                      f"source {REPO}/slurm/env.sh\ncd {tmp_path}\nGPUS_PER_NODE=2\n{recipe}\n")
    p = subprocess.run(["sbatch", "--wait", "--time=5", "--nodes=1", "--ntasks-per-node=2",
                        f"--output={tmp_path}/job.out", str(script)], env=env(),
                       capture_output=True, text=True, timeout=300)
    log_text = open(tmp_path / "job.out").read()
    assert p.returncode == 0, log_text[-3000:]
    result = json.load(open(tmp_path / "result.json"))
    assert result["topology"]["world_size"] == 2 and len(result["metrics"]["losses"]) == 3

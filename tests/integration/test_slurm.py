"""launcher=slurm end to end against fake ``sbatch``/``srun``/``sacct`` scripts on PATH: each
measured point becomes its own job with its own node count; the job writes the record; the
generated sbatch script and the sbatch templates carry the right resources and environment."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest

from tests import REPO
from zero_repro.lab.points import Point
from zero_repro import config as C
from zero_repro import validation
from zero_repro.lab import launcher
from zero_repro.lab import records as R
from zero_repro.lab import slurm
from zero_repro.lab import sweep as orchestrate


# Fake Slurm: sbatch logs its arguments, keeps a copy of the script and runs it in the
# background (submitit only writes the job's pickle after sbatch returned the job id) with the
# environment a batch step has; sacct reports COMPLETED once the script exited.
FAKE_SBATCH = r"""#!/bin/bash
d="$FAKE_SLURM_DIR"
n=$(( $(cat "$d/counter" 2>/dev/null || echo 1000) + 1 )); echo $n > "$d/counter"
echo "$@" >> "$d/sbatch_args"
script="${@: -1}"
cp "$script" "$d/job_$n.sbatch"
( sleep 0.2
  SLURM_JOB_ID=$n SLURM_JOB_NUM_NODES=1 SLURM_JOB_NODELIST=fakenode SLURM_NODEID=0 \
  SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NTASKS=1 bash "$script" > "$d/job_$n.log" 2>&1
  echo $? > "$d/job_$n.rc" ) < /dev/null > /dev/null 2>&1 &
echo "Submitted batch job $n"
"""
# sacct: one line per -j job in the --format/-o columns asked for (submitit asks JobID,State,
# NodeList; zero_repro.lab.slurm asks JobID,State,ExitCode), COMPLETED once the script exited
FAKE_SACCT = r"""#!/bin/bash
fmt=JobID,State; jobs=(); header=1
while [ $# -gt 0 ]; do
  case "$1" in
    -j) jobs+=("$2"); shift ;;
    -o|--format) fmt=$2; shift ;;
    -n|--noheader) header=0 ;;
  esac
  shift
done
[ $header = 1 ] && echo "${fmt//,/|}"
for j in ${jobs[@]//,/ }; do
  if [ -f "$FAKE_SLURM_DIR/job_$j.rc" ]; then s=COMPLETED; c="$(cat "$FAKE_SLURM_DIR/job_$j.rc"):0"
  else s=RUNNING; c=0:0; fi
  line=""
  for col in ${fmt//,/ }; do
    case "$col" in JobID) v=$j ;; State) v=$s ;; ExitCode) v=$c ;; NodeList) v=fakenode ;; *) v="" ;; esac
    line="$line|$v"
  done
  echo "${line#|}"
done
"""
FAKE_SRUN = r"""#!/bin/bash
echo "$@" >> "$FAKE_SLURM_DIR/srun_args"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
exec "$@"
"""
# scontrol: `show hostnames LIST` (slurm/env.sh) and `-o show job N` (job state and log paths)
FAKE_SCONTROL = r"""#!/bin/bash
echo "$@" >> "$FAKE_SLURM_DIR/scontrol_args"
args=" $* "
if [[ "$args" == *" show hostnames "* ]]; then echo "${@: -1}"; exit 0; fi
if [[ "$args" == *" show job "* ]]; then
  j=${@: -1}
  if [ -f "$FAKE_SLURM_DIR/job_$j.rc" ]; then s=COMPLETED; else s=RUNNING; fi
  echo "JobId=$j JobState=$s ExitCode=0:0 StdErr=$FAKE_SLURM_DIR/job_$j.log StdOut=$FAKE_SLURM_DIR/job_$j.log"
  exit 0
fi
echo "fake scontrol: unsupported: $*" >&2; exit 1
"""
# every other Slurm client: a real one on PATH would try to reach a cluster
FAKE_OTHER = r"""#!/bin/bash
echo "$(basename "$0") $*" >> "$FAKE_SLURM_DIR/other_args"
"""
SLURM_COMMANDS = ("sbatch", "srun", "sacct", "scontrol", "scancel", "squeue", "sinfo", "salloc",
                  "sacctmgr", "sstat", "sattach")


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    texts = {"sbatch": FAKE_SBATCH, "sacct": FAKE_SACCT, "srun": FAKE_SRUN,
             "scontrol": FAKE_SCONTROL}
    for name in SLURM_COMMANDS:
        text = texts.get(name, FAKE_OTHER)
        p = bindir / name
        p.write_text(text)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    state = tmp_path / "slurm_state"
    state.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(state))
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in [v for v in os.environ if v.startswith("SLURM_")]:
        monkeypatch.delenv(var)  # as on a login node with no cluster configured
    monkeypatch.chdir(REPO)
    return state


def test_fakes_shadow_every_slurm_command(fake_slurm):
    """The real commands (a cluster's login node, CI) must never be reached from these tests."""
    import shutil

    bindir = os.environ["PATH"].split(os.pathsep)[0]
    for name in SLURM_COMMANDS:
        assert shutil.which(name) == os.path.join(bindir, name), name



# --- the experiment the jobs import by module name (tests.integration.test_slurm) -----------------------
def plan(cfg):
    return [Point("w32", {"w": 32}, {"parallel.world_size": 32, "parallel.tp": 16}),
            Point("w16", {"w": 16}, {"parallel.world_size": 16, "parallel.tp": 16}),
            Point("analytic", {"w": 0}, mode="analytic")]


def run_point(cfg, point):
    return {"world": cfg.parallel.world_size, "job": os.environ.get("SLURM_JOB_ID", "local"),
            "master_port": os.environ.get("MASTER_PORT", ""), "pid": os.getpid()}


def summarize(records):
    return []


def slurm_cfg(tmp_path) -> C.Config:
    cfg = C.Config()
    cfg.experiment.name = "slurmfake"
    cfg.experiment.results_dir = str(tmp_path / "results")
    cfg.train.progress = False
    cfg.model.n_head = cfg.model.n_embd = 64  # tp 16 must divide heads and hidden
    cfg.cluster = C.ClusterConfig(name="dgx2_v100", device="cuda", backend="nccl",
                                  gpus_per_node=16)
    cfg.launcher = C.LauncherConfig(name="slurm", partition="gpu", account="proj", timeout_min=30)
    return validation.validate(cfg)


def test_each_point_is_its_own_job_with_its_node_count(tmp_path, fake_slurm):
    cfg = slurm_cfg(tmp_path)
    module = sys.modules[__name__]
    res = orchestrate.run_sweep(cfg, module)
    by_point = {r.point: r for r in res.records}
    assert set(by_point) == {"w32", "w16", "analytic"}
    assert all(r.status == "ok" for r in res.records), [r.reason for r in res.records]
    # measured points ran inside the (fake) Slurm jobs, in another process; analytic ran here
    jobs = sorted(int(by_point[p].metrics["job"]) for p in ("w32", "w16"))
    assert jobs == [1001, 1002]
    assert by_point["analytic"].metrics["job"] == "local"
    assert by_point["w32"].metrics["pid"] != os.getpid()
    # slurm/env.sh exports no port of its own (each step's rank 0 binds one): the job's is
    # whatever the submitter had
    assert by_point["w32"].metrics["master_port"] == os.environ.get("MASTER_PORT", "")
    assert by_point["w32"].hardware.get("slurm_job_id") == by_point["w32"].metrics["job"]
    assert by_point["w32"].topology["nodes"] == 2 and by_point["w16"].topology["nodes"] == 1

    # the records were written by the jobs into the store, once each
    recs = R.RecordStore.for_experiment(cfg.experiment.results_dir, "slurmfake").load()
    assert sorted(r.point for r in recs) == ["analytic", "w16", "w32"]

    # generated scripts: own node count, one task per GPU in the allocation, GPUs, partition,
    # the point runner started once (no srun around it: run_training's srun starts the ranks)
    scripts = {}
    for n in (1001, 1002):
        text = (fake_slurm / f"job_{n}.sbatch").read_text()
        nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text)[1])
        scripts[nodes] = text
    assert sorted(scripts) == [1, 2]
    for text in scripts.values():
        assert "#SBATCH --ntasks-per-node=16" in text
        assert "#SBATCH --gpus-per-node=16" in text
        assert "#SBATCH --partition=gpu" in text and "#SBATCH --account=proj" in text
        assert "#SBATCH --time=30" in text and "#SBATCH --exclusive" in text
        assert f"source {REPO}/slurm/env.sh" in text
        assert "submitit.core._submit" in text and "\nsrun " not in text
        assert text.count("--ntasks-per-node") == 1 and text.count("--nodes") == 1
    args = (fake_slurm / "sbatch_args").read_text().splitlines()
    assert len(args) == 2 and all(a.endswith("submission_file.sh") or a.endswith(".sh")
                                  for a in args)

    # resume: nothing is resubmitted
    res2 = orchestrate.run_sweep(cfg, module)
    assert res2.records == [] and len(res2.skipped) == 3
    assert len((fake_slurm / "sbatch_args").read_text().splitlines()) == 2


def test_point_file_runner(tmp_path, fake_slurm):
    """``plan`` writes point files; slurm/run_point.sh runs one and records it."""
    cfg = slurm_cfg(tmp_path)
    module = sys.modules[__name__]
    planned = orchestrate.plan(cfg, module)
    files = orchestrate.write_point_files(planned, module, "manual", str(tmp_path / "points"))
    # only points that need a cluster get a file (not the analytic one)
    keys = {pp.point.name: pp.key for pp in planned}
    assert sorted(os.path.basename(f) for f in files) == sorted(
        f"{keys[n]}.yaml" for n in ("w32", "w16"))
    target = next(f for f in files if os.path.basename(f) == f"{keys['w32']}.yaml")
    # a point already done gets none either
    assert len(orchestrate.write_point_files(planned, module, "manual", str(tmp_path / "p2"),
                                             done={keys["w16"]})) == 1
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="fakenode",
               PYTHON=sys.executable)  # the interpreter running the tests, not PATH's
    p = subprocess.run(["bash", os.path.join(REPO, "slurm", "run_point.sh"), target],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    (rec,) = R.RecordStore.for_experiment(cfg.experiment.results_dir, "slurmfake").load()
    assert rec.point == "w32" and rec.status == "ok" and rec.metrics["world"] == 32
    assert rec.metrics["master_port"] == os.environ.get("MASTER_PORT", "")  # none from env.sh
    assert rec.sweep_id == "manual"


@pytest.mark.parametrize("name,gpus", [("dgx2_v100", 16), ("a100", 8)])
def test_sbatch_templates(name, gpus):
    path = os.path.join(REPO, "slurm", f"{name}.sbatch")
    text = open(path).read()
    # the header's plan command names clusters that exist, with this template's GPUs per node
    named = set(re.findall(r"cluster=(\w+)", text)) - {"local"}  # local: the CPU override note
    assert named
    for cluster in named:
        conf = os.path.join(REPO, "conf", "cluster", f"{cluster}.yaml")
        assert os.path.exists(conf), cluster
        assert f"gpus_per_node: {gpus}" in open(conf).read(), cluster
        assert slurm.sbatch_command(_cluster_cfg(cluster), 1).split()[-2] == f"slurm/{name}.sbatch"
    assert "--gpus-per-node=0" in text  # the CPU-partition override is documented
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    assert f"#SBATCH --ntasks-per-node={gpus}" in text
    assert f"#SBATCH --gpus-per-node={gpus}" in text
    assert "slurm/run_point.sh" in text
    env = open(os.path.join(REPO, "slurm", "env.sh")).read()
    for var in ("MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_IB_DISABLE"):
        assert var in env


def test_slurm_parameters_for_cpu_cluster():
    cfg = C.Config()
    cfg.launcher = C.LauncherConfig(name="slurm")
    p = orchestrate.slurm_parameters(cfg, "x")
    assert p["additional_parameters"] == {"nodes": 1, "ntasks_per_node": 2}
    assert "gpus_per_node" not in p and "partition" not in p and p["use_srun"] is False


def _cluster_cfg(name: str) -> C.Config:
    from omegaconf import OmegaConf

    cfg = C.Config()
    doc = OmegaConf.load(os.path.join(REPO, "conf", "cluster", f"{name}.yaml"))
    for k in ("name", "device", "backend", "gpus_per_node"):
        if k in doc:
            setattr(cfg.cluster, k, doc[k])
    return cfg


def test_plan_hint_for_cpu_cluster_has_the_overrides():
    cfg = C.Config()  # cluster=local: CPU, 2 per node
    assert slurm.sbatch_command(cfg, 1) == ("sbatch --nodes=1 --gpus-per-node=0 "
                                            "--ntasks-per-node=2 --cpus-per-task=1 "
                                            "slurm/a100.sbatch FILE")


def test_status_from_slurm_state():
    assert [slurm.status_of(s) for s in ("COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                         "PREEMPTED", "OUT_OF_MEMORY", "FAILED", "BOOT_FAIL",
                                         "WHATEVER")] == [
        "ok", "cancelled", "timeout", "node_fail", "preempted", "oom", "failed", "failed",
        "failed"]
    assert set(slurm.STATUS_OF_STATE.values()) <= set(R.STATUSES)


def test_reason_quotes_the_logs_last_error_lines(tmp_path):
    log = tmp_path / "job.err"
    log.write_text("step 1\nstep 2\nRuntimeError: Distributed package doesn't have NCCL built in\n"
                   "srun: error: node1: task 0: Exited with exit code 1\nbye\n")
    text = slurm.describe_end("77", "FAILED", "1:0", [str(log)])
    assert text.startswith("Slurm job 77 ended FAILED (exit code 1:0)")
    assert f"last error lines of {log}:" in text
    assert "NCCL built in" in text and "task 0: Exited" in text and "step 1" not in text


def test_srun_command_inside_allocation_and_inside_a_step():
    cfg = C.Config()
    cfg.launcher = C.LauncherConfig(name="slurm")
    batch = launcher.launch_command(cfg, "c.yaml", "o.json", env={"SLURM_CPUS_ON_NODE": "8"})
    assert batch[:6] == ["srun", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
                         "--kill-on-bad-exit=1", "--cpus-per-task=4"]
    assert "--overlap" not in batch
    # a Hydra submitit job runs its task in step 0: the ranks' step must share its CPUs
    step = launcher.launch_command(cfg, "c.yaml", "o.json",
                                 env={"SLURM_CPUS_ON_NODE": "2", "SLURM_STEP_ID": "0"})
    assert "--overlap" in step and "--cpus-per-task=1" in step


def test_ranks_survive_the_time_limit_warning(tmp_path):
    """SIGUSR2 (submitit's --signal) is noted, not fatal, in a worker process."""
    code = ("import os, signal, time; from zero_repro.lab import rank as worker; "
            "signal.signal(worker.TIME_LIMIT_SIGNAL, worker._note_time_limit_signal); "
            "os.kill(os.getpid(), signal.SIGUSR2); time.sleep(0.2); "
            "print(worker._signals_seen[0]['signal'])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0 and p.stdout.strip() == "SIGUSR2", p.stderr

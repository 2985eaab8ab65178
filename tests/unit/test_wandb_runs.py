"""W&B mirror: values reach the logger (through the backend seam), an offline run directory is
written without network, and the mirror is a no-op when disabled or wandb is missing."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from zero_repro import config as C
from zero_repro import schema
from zero_repro import validation
from zero_repro.lab import sweep as orchestrate
from zero_repro.lab.records import Record
from zero_repro.lab.wandb_runs import WandbMirror, flatten, step_rows
from zero_repro.lab.wandb_runs import StepLogger

# every series the training loop logs live, once per step (CPU run: memory is the peak RSS)
LIVE_SERIES = ("loss", "grad_norm", "loss_scale", "step_time_s", "tokens_per_s",
               "tflops_per_gpu", "memory/max_rss")


def record(status="ok") -> Record:
    return Record(key="abc", experiment="smoke", point="tiny_tp2", params={"tp": 2},
                  mode="measured", status=status,
                  metrics={"losses": [6.0, 5.5, 5.0], "tokens_per_s": 1234.5, "loss_first": 6.0},
                  memory={"fp32_master": 4096, "adam": 8192},
                  comm={"dp": {"all_reduce": {"volume": 200}}},
                  config=schema.summary(C.Config()), git_sha="deadbeef")


class FakeRun:
    def __init__(self, kwargs):
        self.kwargs, self.logged, self.summary, self.finished = kwargs, [], {}, None
        self.dir = "fake-dir"

    def log(self, data, step=None):
        self.logged.append((step, data))

    def finish(self, exit_code=0):
        self.finished = exit_code


class FakeWandb:
    def __init__(self):
        self.runs: list[FakeRun] = []

    def init(self, **kwargs):
        self.runs.append(FakeRun(kwargs))
        return self.runs[-1]


def wandb_cfg(**kw) -> C.LoggingConfig:
    return C.LoggingConfig(**{"wandb": True, "wandb_mode": "offline", **kw})


def test_values_reach_the_logger():
    fake = FakeWandb()
    m = WandbMirror(wandb_cfg(), "sweep-1", backend=fake)
    m.log_record(record())
    (run,) = fake.runs
    assert run.kwargs["group"] == "smoke" and run.kwargs["job_type"] == "sweep-1"
    assert run.kwargs["mode"] == "offline" and run.kwargs["name"] == "tiny_tp2"
    assert run.kwargs["config"]["params"] == {"tp": 2} and run.kwargs["config"]["zero"]["stage"] == 0
    assert run.logged == [(0, {"loss": 6.0}), (1, {"loss": 5.5}), (2, {"loss": 5.0})]
    assert run.summary["tokens_per_s"] == 1234.5
    assert run.summary["memory/fp32_master"] == 4096 and run.summary["memory/adam"] == 8192
    assert run.summary["comm/dp/all_reduce/volume"] == 200
    assert "losses" not in run.summary and run.finished == 0


def test_noop_when_disabled_or_unimportable(monkeypatch):
    fake = FakeWandb()
    WandbMirror(C.LoggingConfig(wandb=False), "s", backend=fake).log_record(record())
    WandbMirror(wandb_cfg(wandb_mode="disabled"), "s", backend=fake).log_record(record())
    assert fake.runs == []
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    m = WandbMirror(wandb_cfg(), "s")
    assert not m.enabled
    m.log_record(record())  # nothing raised


def test_backend_errors_never_break_the_sweep(tmp_path):
    class Broken(FakeWandb):
        def init(self, **kwargs):
            raise RuntimeError("no network")

    m = WandbMirror(wandb_cfg(), "s", backend=Broken())
    m.log_record(record())
    assert not m.enabled


def test_sweep_mirrors_each_record(tmp_path):
    from tests.unit.test_records import FakeExperiment, make_cfg

    fake = FakeWandb()
    cfg = make_cfg(tmp_path)
    orchestrate.run_sweep(cfg, FakeExperiment(n=2, oom_at={1}),
                          mirror=WandbMirror(wandb_cfg(), "sw", backend=fake))
    assert [r.kwargs["name"] for r in fake.runs] == ["p0", "p1"]
    assert [r.finished for r in fake.runs] == [0, 1]
    assert fake.runs[1].summary["status"] == "oom"


def test_offline_run_directory_written(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    m = WandbMirror(wandb_cfg(), "sweep-off")
    assert m.enabled
    m.log_record(record())
    assert m.enabled, "the offline run failed (see the log)"
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    files = [os.path.basename(p) for p in glob.glob(os.path.join(runs[0], "*"))]
    assert any(f.endswith(".wandb") and os.path.getsize(os.path.join(runs[0], f)) > 0
               for f in files), files


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": [1]}) == {"a/b": 1, "a/c/d": 2, "e": [1]}


def test_record_series_logged_as_one_dict_per_step():
    """W&B drops a log whose step goes backwards: every series goes into ONE call per step."""
    fake = FakeWandb()
    rec = record()
    rec.metrics.update(grad_norms=[1.0, 0.9, 0.8], loss_scales=[1, 1, 1], step_times_s=[0.2, 0.3])
    WandbMirror(wandb_cfg(), "s", backend=fake).log_record(rec)
    (run,) = fake.runs
    assert [step for step, _ in run.logged] == [0, 1, 2]
    assert run.logged[0] == (0, {"loss": 6.0, "grad_norm": 1.0, "loss_scale": 1})
    assert run.logged[2][1] == {"loss": 5.0, "grad_norm": 0.8, "loss_scale": 1,
                                "step_time_s": 0.3}
    assert step_rows({}) == []


def test_resumed_record_series_at_their_true_steps():
    """A run resumed at step 3 of 6: its own losses are steps 3-5, the checkpoint's 0-2."""
    m = {"start_step": 3, "losses": [4.0, 3.5, 3.0], "losses_before_start": [6.0, 5.5, 5.0],
         "grad_norms": [0.3, 0.2, 0.1], "step_times_s": [0.2, 0.25]}
    rows = step_rows(m)
    assert [s for s, _ in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[0] == (0, {"loss": 6.0})
    assert rows[3] == (3, {"loss": 4.0, "grad_norm": 0.3})
    assert rows[5] == (5, {"loss": 3.0, "grad_norm": 0.1, "step_time_s": 0.25})
    # without the carried-over losses the series still start at step 3
    m.pop("losses_before_start")
    assert [s for s, _ in step_rows(m)] == [3, 4, 5]


def test_live_record_is_not_mirrored_twice():
    fake = FakeWandb()
    rec = record()
    rec.metrics["wandb_run"] = "abc123"  # logged live by the point's rank 0
    WandbMirror(wandb_cfg(), "s", backend=fake).log_record(rec)
    assert fake.runs == []


def test_step_logger_one_call_per_step_then_summary(tmp_path):
    fake = FakeWandb()
    cfg = C.Config()
    cfg.logging = wandb_cfg()
    live = StepLogger.start(cfg, str(tmp_path), backend=fake)
    for step in range(3):
        live.log_step(step, loss=1.0 / (step + 1), grad_norm=0.5, step_time_s=0.1)
    assert live.finish({"status": "ok", "loss_last": 1 / 3}, 0) == ""  # FakeRun has no id
    (run,) = fake.runs
    assert [s for s, _ in run.logged] == [0, 1, 2]
    assert all(set(d) == {"loss", "grad_norm", "step_time_s"} for _, d in run.logged)
    assert run.kwargs["config"]["train"]["steps"] == cfg.train.steps
    assert run.summary["status"] == "ok" and run.finished == 0
    # off on other ranks / when disabled
    assert not StepLogger.start(cfg, str(tmp_path), enabled=False, backend=fake).active


def _wandb_cli(*args: str, cwd: str) -> subprocess.CompletedProcess:
    # the `wandb` entry point of this interpreter's environment
    exe = os.path.join(os.path.dirname(sys.executable), "wandb")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true"))


def test_offline_training_run_read_back_with_wandb_tools(tmp_path, monkeypatch):
    """A real 8-step training point with logging.wandb=true, offline; the run is read back with
    W&B's own tools (`wandb sync --dry-run`, `wandb leet inspect --json`, which parses the
    .wandb transaction log): every series holds 8 points, logged during training."""
    from experiments import smoke

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = C.Config()
    cfg.experiment.name, cfg.experiment.results_dir = "smoke", str(tmp_path / "results")
    cfg.parallel.world_size, cfg.parallel.tp = 2, 2
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.micro_batch_size = 8, 1, 2
    cfg.train.progress = False
    cfg.logging = wandb_cfg()
    cfg = validation.validate(cfg)
    mirror = WandbMirror(cfg.logging, "sweep-live")
    res = orchestrate.run_sweep(cfg, smoke, mirror=mirror, sweep_id="sweep-live")
    (rec,) = res.records
    assert rec.status == "ok", rec.reason
    run_id = rec.metrics["wandb_run"]
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}"))
    assert mirror.runs == []  # nothing mirrored after the point: it was logged live

    dry = _wandb_cli("sync", "--dry-run", run_dir, cwd=str(tmp_path))
    assert dry.returncode == 0 and f"run-{run_id}.wandb" in dry.stdout + dry.stderr, dry

    leet = _wandb_cli("leet", "inspect", "--json", run_dir, cwd=str(tmp_path))
    assert leet.returncode == 0, leet.stderr
    recs = [json.loads(line) for line in leet.stdout.splitlines() if line.strip()]
    history = [r["history"]["item"] for r in recs if r.get("type") == "history"]
    assert [h["_step"] for h in history] == list(range(8))  # one log call per step
    for name in LIVE_SERIES:
        assert sum(name in h for h in history) == 8, name
    assert [h["loss"] for h in history] == pytest.approx(rec.metrics["losses"], rel=1e-6)
    assert [h["grad_norm"] for h in history] == pytest.approx(rec.metrics["grad_norms"])
    # live: each step was written when it ran, not in one burst after the point
    stamps = [h["_timestamp"] for h in history]
    assert stamps == sorted(stamps)
    assert stamps[-1] - stamps[0] >= 0.5 * sum(h["step_time_s"] for h in history[1:])

    (run,) = [r["run"] for r in recs if r.get("type") == "run"]
    config = run["config"]["update"]
    assert config["train"]["steps"] == 8 and config["zero"]["stage"] == 0
    assert run["run_group"] == "smoke" and run["job_type"] == "sweep-live"
    assert run["display_name"] == rec.point and run["run_id"] == run_id
    summary = {}
    for r in recs:
        if r.get("type") == "summary":
            summary.update(r["summary"].get("update", {}))
    assert summary["status"] == "ok" and summary["loss_last"] == pytest.approx(
        rec.metrics["loss_last"])
    assert any(k.startswith("memory/") for k in summary)

"""W&B mirror: values reach the logger (through the backend seam), an offline run directory is
written without network, and the mirror is a no-op when disabled or wandb is missing."""
from __future__ import annotations

import glob
import os
import sys

from zero_repro import config as C
from zero_repro.harness import sweep as orchestrate
from zero_repro.harness.records import Record
from zero_repro.wandb_log import WandbMirror, flatten


def record(status="ok") -> Record:
    return Record(key="abc", experiment="smoke", point="tiny_tp2", params={"tp": 2},
                  mode="measured", status=status,
                  metrics={"losses": [6.0, 5.5, 5.0], "tokens_per_s": 1234.5, "loss_first": 6.0},
                  memory={"fp32_master": 4096, "adam": 8192},
                  comm={"dp": {"all_reduce": {"volume": 200}}},
                  config=C.summary(C.Config()), git_sha="deadbeef")


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
    from tests.test_records import FakeExperiment, make_cfg

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

"""Plan once: one command plans its sweep once and hands the plan on (cli -> sweep -> run);
each point is validated and pre-flighted once; a direct call of the training entry still
checks its input.

Counted through the real CLI entry (``cli.main`` in this process, a registered 3-point
experiment whose points go through ``launcher.run_training``; the ranks are a stand-in that
returns a result at once: what is counted happens in the CLI process)."""
from __future__ import annotations

import collections
import signal
import sys

import pytest

from zero_repro import config as C
from zero_repro import validation
from zero_repro.lab import cli, launcher, registry, sweep
from zero_repro.lab.points import Point
from zero_repro.runtime.comm import launch


class ThreePoints:
    def __init__(self, calls):
        self.calls = calls

    def plan(self, cfg):
        self.calls["experiment.plan"] += 1
        return [Point(name=f"p{i}", params={"i": i}, overrides={"train.seed": i})
                for i in range(3)]

    def run_point(self, cfg, point):
        return launcher.run_training(cfg, point.run_dir, point.checked)

    def summarize(self, records):
        return []


@pytest.fixture
def counted(monkeypatch):
    calls = collections.Counter()

    def count(owner, name):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            calls[name] += 1
            return real(*a, **k)

        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in [(sweep, "plan"), (validation, "validate"), (launcher, "check_runnable"),
                        (sweep, "reusable_keys"), (sweep, "_finished_elsewhere")]:
        count(owner, name)

    def ranks(fn, world, path, **kw):
        calls["spawn"] += 1
        return [{"metrics": {"losses": [2.0, 1.0]}}]

    monkeypatch.setattr(launch, "spawn", ranks)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield calls
    for s, h in handlers.items():  # cli.main installs its own
        signal.signal(s, h)
    cli._signalled.clear()
    registry.unregister("plan_once")


def test_a_three_point_sweep_plans_validates_and_checks_each_point_once(
        counted, monkeypatch, tmp_path):
    registry.register("plan_once", ThreePoints(counted))
    monkeypatch.setattr(sys, "argv", [
        "run.py", "+exp=smoke", "experiment.name=plan_once", "train.progress=false",
        f"experiment.results_dir={tmp_path / 'r'}", f"hydra.run.dir={tmp_path / 'hydra'}"])
    cli.main()
    assert counted["spawn"] == 3
    assert counted["experiment.plan"] == 1 and counted["plan"] == 1
    assert counted["validate"] == 1 + 3  # the command's config, then each point's
    assert counted["check_runnable"] == 3  # each point, before the first one starts
    assert counted["reusable_keys"] == 1
    # under each point's lock, one look at the store (another sweep may have finished it)
    assert counted["_finished_elsewhere"] == 3


def test_the_training_entry_called_directly_still_checks_its_input(counted, tmp_path):
    cfg = C.Config()
    cfg.train.steps, cfg.train.warmup_steps = 2, 0
    launcher.run_training(cfg, str(tmp_path / "run"))
    assert counted["validate"] == 1 and counted["check_runnable"] == 1
    cfg.train.lr = -1.0
    with pytest.raises(ValueError, match="train.lr"):
        launcher.run_training(cfg, str(tmp_path / "run"))
    assert counted["spawn"] == 1


def test_a_pre_flighted_point_whose_config_changed_is_checked_again(counted, tmp_path):
    cfg = C.Config()
    cfg.train.steps, cfg.train.warmup_steps = 2, 0
    pre = launcher.checked(cfg, str(tmp_path / "run"), None)
    launcher.run_training(cfg, str(tmp_path / "run"), pre)
    assert counted["check_runnable"] == 0  # taken as checked
    launcher.run_training(cfg, str(tmp_path / "run"))
    assert counted["check_runnable"] == 1  # no verdict handed on: checked
    pre = launcher.checked(cfg, str(tmp_path / "run"), None)
    cfg.train.seed = 7  # changed after its check: not the input that was checked
    launcher.run_training(cfg, str(tmp_path / "run"), pre)
    assert counted["check_runnable"] == 2

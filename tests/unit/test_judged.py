"""The store of judged depths (lab/judged.py) and the max-size judge reading it."""
from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf

from zero_repro.lab import judged
from zero_repro.scale.dryrun import maxsize
from tests.unit.test_dryrun_twin import fig6_cfg


def test_store_round_trip_last_line_wins_and_force_reads_nothing(tmp_path):
    path = tmp_path / "judged" / "sig.jsonl"
    s = judged.JudgedStore(path)
    assert s.get(["a", 2, 1e9]) is None
    s.put(["a", 2, 1e9], {"min_capacity": 5})
    s.put(["a", 2, 1e9], {"min_capacity": 6})
    with open(path, "a") as f:
        f.write('{"key": "cut sho')  # a run killed mid-line
    assert judged.JudgedStore(path).get(["a", 2, 1e9]) == {"min_capacity": 6}
    assert judged.JudgedStore(path).get(["a", 2, 2e9]) is None  # another capacity
    assert judged.JudgedStore(path, read=False).get(["a", 2, 1e9]) is None


def test_for_experiment_is_per_code_and_force_writes_only(tmp_path):
    cfg = OmegaConf.create({"experiment": {"results_dir": str(tmp_path), "force": False}})
    s = judged.for_experiment(cfg)
    assert s.path.parent == tmp_path / "judged" and s.read
    cfg.experiment.force = True
    assert not judged.for_experiment(cfg).read


def test_a_judge_with_a_store_does_not_dry_run_a_depth_judged_before(tmp_path):
    cfg = fig6_cfg("C1", "paper2020", 3)
    store = judged.JudgedStore(tmp_path / "j.jsonl")
    first = maxsize.DryRunJudge(cfg, 30e9, store=store)
    first(3)
    need = first.probe(3)
    maxsize.DryRunJudge._shared.clear()  # as in a new process
    again = maxsize.DryRunJudge(cfg, 30e9, store=judged.JudgedStore(tmp_path / "j.jsonl"))
    assert again(3) == first.memo[3].fits and again.probe(3) == need
    assert again.n_runs == 0
    assert dataclasses.asdict(again.memo[3]) == {**dataclasses.asdict(first.memo[3]),
                                                  "min_capacity": need}
    other = maxsize.DryRunJudge(cfg, 20e9, store=judged.JudgedStore(tmp_path / "j.jsonl"))
    other(3)
    assert other.n_runs == 1  # another capacity: judged anew

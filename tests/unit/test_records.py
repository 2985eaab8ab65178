"""Records, resumable sweeps, OOM-as-data, interrupted sweeps, tables vs the paper reference.

All with fake experiments (no training): the framework is what is under test here."""
from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from zero_repro.lab.figures import paper_compare
from zero_repro.lab.figures import regenerate as plot
from zero_repro.lab import registry as base
from zero_repro.lab import points
from zero_repro.lab.points import Point
from zero_repro import config as C
from zero_repro import identity
from zero_repro import schema
from zero_repro.lab import sweep as orchestrate
from zero_repro.lab import records as R


def make_cfg(tmp_path, name="fake", **experiment) -> C.Config:
    cfg = C.Config()
    cfg.experiment.name = name
    cfg.experiment.results_dir = str(tmp_path / "results")
    cfg.train.progress = False
    for k, v in experiment.items():
        setattr(cfg.experiment, k, v)
    return cfg


class FakeExperiment:
    """N points over zero.stage x a size param; counts calls; can OOM, fail or be interrupted."""

    PAPER_FIGURE = None

    def __init__(self, n=4, oom_at=(), fail_at=(), interrupt_at=None):
        self.n, self.oom_at, self.fail_at, self.interrupt_at = n, set(oom_at), set(fail_at), interrupt_at
        self.calls: list[int] = []

    def plan(self, cfg):
        return [Point(name=f"p{i}", params={"i": i}, overrides={"train.seed": 100 + i})
                for i in range(self.n)]

    def run_point(self, cfg, point):
        i = point.params["i"]
        assert cfg.train.seed == 100 + i  # the point's overrides reached its config
        assert os.path.isdir(point.run_dir)
        if i == self.interrupt_at:
            raise KeyboardInterrupt
        self.calls.append(i)
        if i in self.oom_at:
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if i in self.fail_at:
            raise RuntimeError("boom")
        return {"metrics": {"y": float(i) ** 2, "losses": [3.0, 2.0]},
                "memory": {"fp32_master": 4 * i}, "comm": {"volume": 2 * i}}

    def summarize(self, records):
        return [{"figure": "fake", "series": "s", "x_name": "i", "x_value": r.params["i"],
                 "y_name": "y", "y_value": r.metrics["y"], "unit": "u", "kind": r.mode}
                for r in records if r.status == "ok"]


def test_record_fields_and_store(tmp_path):
    cfg = make_cfg(tmp_path)
    exp = FakeExperiment(n=2)
    res = orchestrate.run_sweep(cfg, exp)
    store = R.RecordStore.for_experiment(cfg.experiment.results_dir, "fake")
    recs = store.load()
    assert [r.point for r in recs] == ["p0", "p1"] and all(r.status == "ok" for r in recs)
    r = recs[1]
    assert r.metrics["y"] == 1.0 and r.memory == {"fp32_master": 4} and r.comm == {"volume": 2}
    assert r.config["train"]["seed"] == 101 and r.mode == "measured"
    assert r.topology["world_size"] == 2 and r.topology["nodes"] == 1
    assert r.hardware["cpu_count"] == os.cpu_count() and r.hardware["torch"]
    assert r.git_sha and r.hostname and r.timestamp and r.sweep_id == res.sweep_id
    # one JSON object per line, nothing else in results/<exp>/ but the JSONL and runs/
    lines = open(store.path).read().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["key"] == recs[0].key
    assert sorted(os.listdir(os.path.dirname(store.path))) == ["points.jsonl", "runs"]


def test_point_key_is_stable_and_sensitive():
    c = schema.summary(C.Config())
    k = R.point_key({"a": 1, "b": [1, 2]}, "measured", c)
    assert k == R.point_key({"b": [1, 2], "a": 1}, "measured", c)  # order-independent
    assert len(k) == 16
    assert k != R.point_key({"a": 2, "b": [1, 2]}, "measured", c)
    assert k != R.point_key({"a": 1, "b": [1, 2]}, "simulated", c)
    c2 = schema.summary(C.Config())
    c2["zero"]["stage"] = 2
    assert k != R.point_key({"a": 1, "b": [1, 2]}, "measured", c2)
    c3 = schema.summary(C.Config())
    c3["train"]["progress"] = False  # display knob: same point
    c3["logging"]["wandb"] = True
    assert k == R.point_key({"a": 1, "b": [1, 2]}, "measured", c3)


def test_resume_skips_done_points_and_force_reruns(tmp_path):
    cfg = make_cfg(tmp_path)
    exp = FakeExperiment(n=3, fail_at={2})
    orchestrate.run_sweep(cfg, exp)
    assert exp.calls == [0, 1, 2]
    exp2 = FakeExperiment(n=3)  # the failed point is retried, the done ones skipped
    res = orchestrate.run_sweep(cfg, exp2)
    assert exp2.calls == [2] and len(res.skipped) == 2
    recs = R.RecordStore.for_experiment(cfg.experiment.results_dir, "fake").load()
    assert sorted(r.point for r in recs) == ["p0", "p1", "p2"]  # failed record replaced
    assert all(r.status == "ok" for r in recs)
    cfg.experiment.force = True
    exp3 = FakeExperiment(n=3)
    orchestrate.run_sweep(cfg, exp3)
    assert exp3.calls == [0, 1, 2]
    assert len(R.RecordStore.for_experiment(cfg.experiment.results_dir, "fake").load()) == 3


def test_oom_is_recorded_and_sweep_continues(tmp_path):
    cfg = make_cfg(tmp_path)
    exp = FakeExperiment(n=4, oom_at={1}, fail_at={2})
    res = orchestrate.run_sweep(cfg, exp)
    assert exp.calls == [0, 1, 2, 3]
    status = {r.point: (r.status, r.reason) for r in res.records}
    assert status["p1"][0] == "oom" and "out of memory" in status["p1"][1]
    assert status["p2"] == ("failed", "RuntimeError: boom")
    assert status["p0"][0] == status["p3"][0] == "ok"
    # an OOM is a result: not re-run; a failure is
    exp2 = FakeExperiment(n=4)
    orchestrate.run_sweep(cfg, exp2)
    assert exp2.calls == [2]
    # a WorkerFailed from a remote rank carrying an OOM traceback is an OOM too
    from zero_repro.runtime.comm.launch import WorkerFailed

    assert R.classify_failure(WorkerFailed(1, "OutOfMemoryError: CUDA out of memory"))[0] == "oom"
    assert R.classify_failure(MemoryError())[0] == "oom"


def test_interrupted_sweep_loses_and_duplicates_nothing(tmp_path):
    cfg = make_cfg(tmp_path)
    exp = FakeExperiment(n=5, interrupt_at=3)
    with pytest.raises(KeyboardInterrupt):
        orchestrate.run_sweep(cfg, exp)
    store = R.RecordStore.for_experiment(cfg.experiment.results_dir, "fake")
    # the interrupted point is recorded as cancelled: not done, it runs again next time
    assert [(r.point, r.status) for r in store.load()] == [
        ("p0", "ok"), ("p1", "ok"), ("p2", "ok"), ("p3", "cancelled")]
    assert not [f for f in os.listdir(os.path.dirname(store.path)) if f.endswith(".tmp")]
    exp2 = FakeExperiment(n=5)
    orchestrate.run_sweep(cfg, exp2)
    assert exp2.calls == [3, 4]
    recs = store.load()
    keys = [r.key for r in recs]
    assert len(keys) == len(set(keys)) == 5
    assert sorted(r.point for r in recs) == [f"p{i}" for i in range(5)]


def test_invalid_point_stops_before_anything_runs(tmp_path):
    cfg = make_cfg(tmp_path)

    class Bad(FakeExperiment):
        def plan(self, cfg):
            return super().plan(cfg) + [Point("bad", {"i": 9}, {"parallel.tp": 3})]

    exp = Bad(n=2)
    with pytest.raises(ValueError, match="point .bad.*parallel.tp=3 does not divide"):
        orchestrate.run_sweep(cfg, exp)
    assert exp.calls == []
    with pytest.raises(ValueError, match="names no config key"):
        orchestrate.point_config(cfg, {"zero.nonexistent": 1})


def test_table_and_plot_from_results_alone(tmp_path):
    """fig3-like fake: per-GPU throughput at 64/128 GPUs joined to the paper's values."""
    ref = paper_compare.load_reference()
    fam = "ZeRO-100B 60B model, Performance/GPU (bars)"
    want = ref[(ref.figure == "fig3") & (ref.series == fam) & (ref.y_name == "throughput_per_gpu")]
    paper_at = {int(float(x)): float(y) for x, y in zip(want.x_value, want.y_value)}
    assert {64, 128} <= set(paper_at)

    class Fig3Like(FakeExperiment):
        PAPER_FIGURE = "fig3"
        SERIES_FAMILY = {"ours (simulated)": fam}

        def plan(self, cfg):
            return [Point(f"g{g}", {"gpus": g}, mode="simulated") for g in (64, 128)]

        def run_point(self, cfg, point):
            return {"tflops": 30.0}

        def summarize(self, records):
            return [{"figure": "fig3", "series": "ours (simulated)", "x_name": "num_gpus",
                     "x_value": r.params["gpus"], "y_name": "throughput_per_gpu",
                     "y_value": r.metrics["tflops"], "unit": "TFLOPs/GPU", "kind": r.mode}
                    for r in records]

    cfg = make_cfg(tmp_path, name="fig3like")
    exp = Fig3Like()
    orchestrate.run_sweep(cfg, exp)
    base.register("fig3like", exp)
    try:
        out = plot.regenerate("fig3like", cfg.experiment.results_dir)
    finally:
        base.unregister("fig3like")
    table = pd.read_csv(out["table"])
    assert list(table.columns[:8]) == points.TABLE_COLUMNS
    ours = table[table.kind == "simulated"].set_index("x_value")
    for g in (64, 128):
        expect = (30.0 - paper_at[g]) / paper_at[g]
        assert ours.loc[g, "rel_error_vs_paper"] == pytest.approx(expect)
        assert ours.loc[g, "paper_value"] == pytest.approx(paper_at[g])
    theirs = table[table.kind == "paper"]
    assert set(theirs.figure) == {"fig3"} and set(theirs.y_name) == {"throughput_per_gpu"}
    assert len(theirs) == len(ref[(ref.figure == "fig3") & (ref.y_name == "throughput_per_gpu")])
    for p in out["figures"]:
        assert os.path.getsize(p) > 1000
    assert sorted(os.path.basename(p) for p in out["figures"]) == ["fig3like.pdf", "fig3like.png"]


def test_summarize_rows_are_checked(tmp_path):
    class Wrong(FakeExperiment):
        def summarize(self, records):
            return [{"figure": "f", "series": "s", "x_name": "x", "x_value": 1, "y_name": "y",
                     "y_value": 1, "unit": "u", "kind": "paper"}]

    with pytest.raises(ValueError, match="kind"):
        plot.build_table(Wrong(), [], paper_compare.load_reference())


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown experiment 'nope'.*smoke"):
        base.get("nope")
    assert "smoke" in base.available()
    assert base.get("smoke").__name__ == "experiments.smoke"
    with pytest.raises(ValueError, match="does not define"):
        base.register("x", object())


def test_newest_ok_keeps_one_record_per_point_across_changed_params():
    # a point whose identifying params changed (e.g. a dry run's traced steps 1 -> 2): the
    # summary shows the newest ok record; a newer failure never hides it; order: first seen
    def rec(point, its, status, ts):
        return R.Record(key=f"{point}{its}", experiment="x", point=point,
                        params={"iterations": its}, mode="simulated", status=status,
                        timestamp=ts)
    old_a, old_b = rec("a", 1, "ok", "2026-01-01T00:00:00"), rec("b", 1, "ok", "2026-01-01T00:00:01")
    new_a = rec("a", 2, "ok", "2026-02-01T00:00:00")
    failed_b = rec("b", 2, "failed", "2026-02-01T00:00:01")
    assert R.newest_ok([old_a, old_b, new_a, failed_b]) == [new_a, old_b]
    assert R.newest_ok([failed_b]) == []


# ------------------------------------------------------------------ identity and migration
def test_identity_is_declared_on_the_fields():
    """What identifies a point is the schema's field metadata: a knob marked
    ``identity: False`` (or a whole section) never changes a key; a knob a record's config lacks
    counts at the value records made before it ran with; a knob the schema no longer has is
    ignored (so removing it orphans nothing once the keys are migrated)."""
    base = schema.summary(C.Config())
    key = R.point_key({"i": 1}, "measured", base)
    for sec, name in [("train", "progress"), ("train", "log_every"),
                      ("cluster", "description")]:
        changed = json.loads(json.dumps(base))
        changed[sec][name] = "something else"
        assert R.point_key({"i": 1}, "measured", changed) == key, (sec, name)
    for sec in ("launcher", "logging", "experiment", "checkpoint", "fault", "simulate"):
        assert sec not in identity.identity(base)
    fossil = json.loads(json.dumps(base))
    fossil["zero"]["overlap_comm"] = False  # a knob that left the schema
    assert R.point_key({"i": 1}, "measured", fossil) == key
    older = json.loads(json.dumps(base))
    del older["zero"]["overlap_param_gather"]  # made before the knob existed: it ran on
    on = json.loads(json.dumps(base))
    on["zero"]["overlap_param_gather"] = True
    assert R.point_key({}, "measured", older) == R.point_key({}, "measured", on) != \
        R.point_key({}, "measured", base)
    assert "overlap_comm" not in {f.name for f in identity.identity_fields()["zero"]}


def test_migrate_rewrites_keys_only_and_is_idempotent(tmp_path):
    store = R.RecordStore(str(tmp_path / "x" / "points.jsonl"))
    recs = [R.Record(key=f"old{i}", experiment="x", point=f"p{i}", params={"i": i},
                     mode="simulated", status="ok", config=schema.summary(C.Config()),
                     metrics={"y": i}) for i in range(3)]
    os.makedirs(os.path.dirname(store.path))
    lines = [r.to_json() for r in recs]
    with open(store.path, "w") as f:
        f.write("\n".join(lines[:2] + ["{torn"] + lines[2:]) + "\n")
    assert R.migrate(store.path) == (3, 3)
    after = open(store.path).read().splitlines()
    assert after[2] == "{torn"  # a line that is no record is kept as it is
    for old, new, rec in zip(lines, [after[0], after[1], after[3]], recs):
        doc = json.loads(new)
        assert doc["key"] == R.point_key(rec.params, rec.mode, rec.config)
        assert {**json.loads(old), "key": doc["key"]} == doc
    assert R.migrate(store.path) == (3, 0)
    assert open(store.path).read().splitlines() == after


def test_a_migrated_record_is_still_reused(tmp_path):
    """A record written under an older key scheme, migrated, stands for its point again."""
    cfg = make_cfg(tmp_path)
    exp = FakeExperiment(n=2)
    orchestrate.run_sweep(cfg, exp)
    store = R.RecordStore.for_experiment(cfg.experiment.results_dir, "fake")
    path = store.path
    text = open(path).read()
    for r in store.load():
        text = text.replace(r.key, "0123456789abcdef"[: len(r.key) - 1] + r.point[-1])
    open(path, "w").write(text)
    exp.calls.clear()
    assert len(orchestrate.run_sweep(cfg, exp).records) == 2 and exp.calls == [0, 1]
    orchestrate.run_sweep(cfg, exp)  # (the re-run replaced them: start again from old keys)
    open(path, "w").write(text)
    assert R.migrate(path) == (2, 2)
    exp.calls.clear()
    res = orchestrate.run_sweep(cfg, exp)
    assert exp.calls == [] and len(res.skipped) == 2 and res.records == []


def test_committed_records_carry_todays_keys():
    """Every committed record's key is today's key of its own params, mode and config."""
    from zero_repro import paths

    for path in sorted(paths.RESULTS_DIR.glob("*/points.jsonl")):
        for r in R.RecordStore(str(path)).load():
            assert r.key == R.point_key(r.params, r.mode, r.config), (path, r.point)

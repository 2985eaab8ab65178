"""A new user's first contact: results go to the user's own directory and are reused
only when made here at this code; series never merge records that differ in a knob; re-plots
are byte-identical; run.py under torchrun refuses instead of nesting launches; --help lists the
experiments; the runnable example trains under torchrun at world 2."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import pytest

from zero_repro import config as C
from zero_repro import schema
from zero_repro import paths
from zero_repro.lab import provenance as P
from zero_repro.lab import records as R
from zero_repro.lab.figures import regenerate
from zero_repro.lab import sweep
from zero_repro.lab.points import Point

import experiments.smoke as smoke

REPO = str(paths.REPO_ROOT)


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"):
        env.pop(k, None)
    return env


# ------------------------------------------------------------------ where results go, reuse
def test_default_results_dir_is_local_and_publish_is_explicit():
    schema.register_configs()
    assert C.Config().experiment.results_dir == "results/local"
    from omegaconf import OmegaConf

    local = schema.to_config(OmegaConf.create({"experiment": {}}))
    assert local.experiment.results_dir == str(paths.home() / "results" / "local")
    pub = schema.to_config(OmegaConf.create({"experiment": {"publish": True}}))
    assert pub.experiment.results_dir == str(paths.RESULTS_DIR)
    other = schema.to_config(OmegaConf.create({"experiment": {"publish": True, "results_dir": "x"}}))
    assert other.experiment.results_dir == os.path.abspath("x")  # an explicit directory wins
    ignored = subprocess.run(["git", "check-ignore", "-q", "results/local/fig3_scaling/t.csv"],
                             cwd=REPO).returncode
    assert ignored == 0, "results/local/ must be git-ignored"


class Counting:
    PAPER_FIGURE = None

    def __init__(self):
        self.calls = 0

    def plan(self, cfg):
        return [Point(name="m", params={"i": 0}, mode="measured"),
                Point(name="s", params={"i": 1}, mode="simulated")]

    def run_point(self, cfg, point):
        self.calls += 1
        return {"y": 1.0}

    def summarize(self, records):
        return []


def test_records_are_reused_only_from_this_machine_and_code(tmp_path):
    cfg = C.Config()
    cfg.experiment.name, cfg.experiment.results_dir = "count", str(tmp_path)
    cfg.train.progress = False
    exp = Counting()
    sweep.run_sweep(cfg, exp)
    assert exp.calls == 2
    store = R.RecordStore.for_experiment(str(tmp_path), "count")
    recs = store.load()
    assert all(r.provenance["code"] == P.code_signature() for r in recs)
    assert next(r for r in recs if r.mode == "measured").provenance["machine"] == \
        P.this_machine()
    sweep.run_sweep(cfg, exp)
    assert exp.calls == 2  # same machine, same code: done
    # the measured record made on other hardware, the simulated one at other code
    for r in recs:
        prov = dict(r.provenance)
        if r.mode == "measured":
            prov["machine"] = dict(prov["machine"], device_name="Other CPU")
        else:
            prov["code"] = "tree:000000000000,000000000000"
        store.put(dataclasses.replace(r, provenance=prov), replace_ok=True)
    res = sweep.run_sweep(cfg, exp)
    assert exp.calls == 4 and len(res.records) == 2 and not res.skipped
    # records from before signatures existed (the committed reference set) are never reused
    old = [dataclasses.replace(r, provenance={}) for r in store.load()]
    assert not any(P.reusable(r, cfg) for r in old)


def test_user_figure_shows_reference_measured_points_labelled_by_hardware(tmp_path):
    recs = R.RecordStore.for_experiment(str(paths.RESULTS_DIR), "fig3_scaling").load()
    mine = []
    for r in recs:  # "this machine": the same points measured on another CPU, at this code
        hw = dict(r.hardware, cpu_model="My Laptop CPU", cpu_count=8)
        mine.append(dataclasses.replace(r, hardware=hw, provenance={"machine": {
            "device": "cpu", "device_name": "My Laptop CPU", "device_count": 8}}))
    store = R.RecordStore.for_experiment(str(tmp_path), "fig3_scaling")
    for r in mine:
        store.put(r)
    out = regenerate.regenerate("fig3_scaling", str(tmp_path))
    import pandas as pd

    t = pd.read_csv(out["table"])
    measured = t[t["kind"] == "measured"]
    assert set(measured["source"]) == {"this machine", "reference"}
    assert measured[measured["source"] == "this machine"]["series"].str.contains(
        "this machine: My Laptop CPU (8 cores)", regex=False).all()
    assert measured[measured["source"] == "reference"]["series"].str.contains(
        "reference: ").all()
    assert not (t[t["kind"] == "simulated"]["series"].str.contains("reference")).any()


# ------------------------------------------------------------------------------ series names
def _smoke_record(**changes) -> R.Record:
    cfg = C.Config()
    cfg.parallel.world_size, cfg.parallel.tp, cfg.train.steps = 2, 1, 8
    for dotted, v in changes.items():
        sec, key = dotted.split(".")
        setattr(getattr(cfg, sec), key, v)
    summary = schema.summary(cfg)
    (pt,) = smoke.plan(cfg)
    steps = cfg.train.steps
    return R.Record(key=R.point_key(pt.params, "measured", summary), experiment="smoke",
                    point=pt.name, params=pt.params, mode="measured", status="ok",
                    metrics={"losses": [5.0 - 0.1 * i for i in range(steps)]},
                    config=summary, timestamp=f"2024-01-0{len(changes) + 1}T00:00:00")


@pytest.mark.parametrize("change", [{"zero.dtype": "bf16"}, {"train.steps": 6},
                                    {"model.n_layer": 4}])
def test_records_differing_in_one_knob_are_two_series(change):
    a, b = _smoke_record(), _smoke_record(**change)
    assert a.key != b.key
    table = regenerate.summary_frame(smoke, [a, b])
    series = list(dict.fromkeys(table["series"]))
    assert len(series) == 2, series
    (knob, value), = change.items()
    assert any(str(value) in s for s in series), series
    assert len(table) == len(a.metrics["losses"]) + len(b.metrics["losses"])


def test_series_name_comes_from_the_resolved_model_not_a_pinned_label():
    r = _smoke_record(**{"model.n_layer": 6, "model.n_embd": 128})
    assert r.config["model"]["name"] == "tiny"  # a label that no longer says the shape
    assert "GPT 6x128" in smoke.summarize([r])[0]["series"]


def test_knob_differences_outside_the_label_still_split_series():
    a, b = _smoke_record(), _smoke_record(**{"train.lr": 1e-3})
    series = set(regenerate.summary_frame(smoke, [a, b])["series"])
    assert len(series) == 2 and any("train.lr=0.001" in s for s in series), series


def test_an_experiment_that_shows_the_newest_record_gets_one_series():
    """NEWEST_ONLY (the dry-run experiments: a re-run with a new method replaces the result)."""
    a, b = _smoke_record(), _smoke_record(**{"train.lr": 1e-3})

    class Newest:
        NEWEST_ONLY = True

        @staticmethod
        def summarize(records):
            return smoke.summarize(R.newest_ok(records))

    table = regenerate.summary_frame(Newest, [a, b])
    assert len(set(table["series"])) == 1 and len(table) == len(b.metrics["losses"])


# --------------------------------------------------------------------------- byte identity
def test_replot_is_byte_identical(tmp_path):
    for name in ("fig3_scaling", "fig2_throughput"):
        dst = tmp_path / name
        dst.mkdir()
        shutil.copy(paths.RESULTS_DIR / name / "points.jsonl", dst / "points.jsonl")
        first = regenerate.regenerate(name, str(tmp_path), reference=False)
        blobs = {p: open(p, "rb").read() for p in first["figures"]}
        second = regenerate.regenerate(name, str(tmp_path), reference=False)
        for p in second["figures"]:
            assert open(p, "rb").read() == blobs[p], p
            committed = paths.RESULTS_DIR / name / os.path.basename(p)
            assert open(p, "rb").read() == committed.read_bytes(), \
                f"{committed} is not what its records plot to: python -m experiments.plot {name}"
        assert b"CreationDate" not in blobs[next(p for p in blobs if p.endswith(".pdf"))]


# ------------------------------------------------------------------------ launcher, --help
def _torchrun() -> str:
    """The torchrun of the interpreter running the tests (a second venv need not be on PATH)."""
    own = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return own if os.path.exists(own) else "torchrun"


def test_run_py_under_torchrun_refuses_instead_of_nesting(tmp_path):
    p = subprocess.run([_torchrun(), "--nproc_per_node", "2", os.path.join(REPO, "run.py"),
                        "+exp=smoke", f"experiment.results_dir={tmp_path}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode != 0
    assert p.stderr.count("error: run.py was started as one of several ranks by torchrun") == 1
    assert not any(tmp_path.iterdir()), "a nested launch ran something"


@pytest.mark.slow
def test_help_lists_experiments_with_a_line_each():
    p = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=_env())
    assert p.returncode == 0
    assert "fig3_scaling         Figure 3: super-linear scalability" in p.stdout
    assert "base_" not in p.stdout and "gpu_throughput" not in p.stdout
    q = subprocess.run([sys.executable, "-m", "experiments.plot"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=_env())
    assert q.returncode == 0 and "smoke" in q.stdout and "gpu_throughput" not in q.stdout


def test_example_runs_under_torchrun_at_world_2(tmp_path):
    ck = tmp_path / "ckpt"
    p = subprocess.run([_torchrun(), "--standalone", "--nproc_per_node", "2", "-m",
                        "zero_repro.examples.minimal", "--steps", "3", "--ckpt-dir", str(ck)],
                       cwd=REPO, capture_output=True, text=True, timeout=240, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "step 2  loss" in out and "TP 1 x DP 2, stage 2" in out
    assert (ck / "step_00000003" / "manifest.json").is_file()


def test_offload_column_replots_in_a_users_results_dir(tmp_path, capsys):
    """``python -m experiments.plot table1_offload --results-dir DIR``: a user's own records
    beside the reference set's, whose measured series carry `` · this machine: <hw>`` /
    `` · reference: <hw>``; the offload column's own plot reads those names too."""
    from zero_repro.lab.cli import print_result

    (tmp_path / "table1_offload").mkdir()
    shutil.copy(paths.RESULTS_DIR / "table1_offload" / "points.jsonl",
                tmp_path / "table1_offload" / "points.jsonl")
    assert regenerate.main(["table1_offload", "--results-dir", str(tmp_path)],
                           report=print_result) == 0, capsys.readouterr().err
    assert (tmp_path / "table1_offload" / "table1_offload.png").stat().st_size > 0
    import pandas as pd

    t = pd.read_csv(tmp_path / "table1_offload" / "table.csv")
    assert set(t[t["kind"] == "measured"]["source"]) == {"this machine", "reference"}

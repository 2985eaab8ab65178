"""The command line: every experiment overlay composes; user errors are one line + exit 2 and
start nothing; plan and plot work from the CLI (no training run here)."""
from __future__ import annotations

import concurrent.futures as cf
import glob
import json
import os
import subprocess
import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from tests import REPO
from zero_repro import schema
from zero_repro import validation
from zero_repro.lab.cli import conf_dir

EXPS = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(REPO, "conf", "exp", "*.yaml")))


def run_cli(*args, cwd=REPO, env=None):
    e = dict(os.environ, HYDRA_FULL_ERROR="0", **(env or {}))
    e.pop("HYDRA_FULL_ERROR")
    return subprocess.run([sys.executable, os.path.join(REPO, "run.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=e)


# these plan paper-scale points through memory dry runs (a minute each on 2 cores): -m slow
PLANS_DRY_RUNS = {"fig2_throughput", "fig3_scaling", "fig4_dp_only", "memory_breakdown",
                  "prediction_memory"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in PLANS_DRY_RUNS
                                  else n for n in EXPS])
def test_every_experiment_overlay_composes_and_validates(name):
    from zero_repro.lab import registry as base
    from zero_repro.lab import sweep as orchestrate

    schema.register_configs()
    # the GPU proof plans its CUDA run anywhere but runs it only on CUDA: its CPU path
    extra = ["experiment.params.device=cpu"] if name == "gpu_proof" else []
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        dcfg = compose("config", overrides=[f"+exp={name}", *extra])
    cfg = validation.validate(schema.to_config(dcfg))
    assert cfg.experiment.name == name, "conf/exp/NAME.yaml must set experiment.name: NAME"
    experiment = base.get(name)  # experiments/NAME.py exists and implements the protocol
    assert orchestrate.plan(cfg, experiment), f"{name}.plan() planned no points"


def test_smoke_overlay_values():
    schema.register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = schema.to_config(compose("config", overrides=["+exp=smoke", "train.steps=3"]))
    assert (cfg.parallel.world_size, cfg.parallel.tp, cfg.model.name) == (2, 1, "tiny")
    assert cfg.train.steps == 3  # command line wins over the overlay


BAD = {
    "tp5_12heads": (["model.n_embd=96", "model.n_head=12", "parallel.tp=5",
                     "parallel.world_size=10"], "parallel.tp=5 does not divide model.n_head=12"),
    "world3_tp2": (["parallel.world_size=3", "parallel.tp=2"],
                   "parallel.world_size=3 is not divisible by parallel.tp=2"),
    "bucket0": (["zero.reduce_bucket_size=0"], "zero.reduce_bucket_size=0 must be a positive"),
    "zero_r_name": (["zero_r.name=c9"], "zero_r.name='c9' is not one of"),
    "zero_r_group": (["zero_r=c9"], "unknown zero_r 'c9'"),
    "unknown_exp": (["+exp=nosuch"], "unknown exp 'nosuch'"),
    "unknown_name": (["experiment.name=nosuch"], "unknown experiment 'nosuch'"),
}


@pytest.mark.slow
def test_user_errors_exit_2_with_one_line_and_start_nothing(tmp_path):
    results = tmp_path / "results"

    def one(case):  # each its own Hydra run directory: two run at once
        args = BAD[case][0]
        exp = [] if any(a.startswith("+exp") for a in args) else ["+exp=smoke"]
        return run_cli(*exp, *args, f"experiment.results_dir={results}",
                       f"hydra.run.dir={tmp_path / 'hydra' / case}")

    with cf.ThreadPoolExecutor(2) as pool:  # two CLI starts at a time (2 cores)
        runs = list(pool.map(one, BAD))
    for (case, (_, message)), p in zip(BAD.items(), runs):
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2, (case, p.returncode, p.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
            (case, p.stderr)
        assert "Traceback" not in p.stdout + p.stderr
        assert not results.exists(), f"{case}: something ran"  # no record, no run dir


@pytest.fixture(scope="module")
def two_quick_commands(tmp_path_factory) -> dict:
    """The run.py commands of the two tests below, started at once (two cores; each is mostly
    interpreter, torch and Hydra start-up), each with a results directory of its own. By
    test: (the finished process, its results directory)."""
    bad, plan = tmp_path_factory.mktemp("type_error"), tmp_path_factory.mktemp("plan")
    with cf.ThreadPoolExecutor(2) as pool:
        type_error = pool.submit(run_cli, "+exp=smoke", "zero.stage=abc",
                                 f"experiment.results_dir={bad}")
        planned = pool.submit(run_cli, "+exp=smoke", "experiment.action=plan",
                              f"experiment.results_dir={plan}", f"hydra.run.dir={plan / 'hydra'}")
        return {"type_error": (type_error.result(), bad), "plan": (planned.result(), plan)}


def test_hydra_type_error_is_a_usage_error(two_quick_commands):
    p, _ = two_quick_commands["type_error"]
    assert p.returncode == 2 and "zero.stage" in p.stderr and "Traceback" not in p.stderr


def test_plan_lists_points_and_writes_point_files(two_quick_commands):
    p, tmp_path = two_quick_commands["plan"]
    assert p.returncode == 0, p.stderr
    assert "fp32 stage 0 w2=tp1xdp2 8 steps" in p.stdout and "todo" in p.stdout
    files = glob.glob(str(tmp_path / "hydra" / "points" / "*.yaml"))
    assert len(files) == 1
    from omegaconf import OmegaConf

    doc = OmegaConf.load(files[0])
    assert doc.experiment_module == "experiments.smoke" and doc.config.parallel.tp == 1
    assert not (tmp_path / "smoke").exists()  # planning runs nothing


def test_plot_action_regenerates_from_results_alone(tmp_path):
    """A smoke record on disk -> table.csv + smoke.png/.pdf, via run.py and experiments.plot."""
    from zero_repro.lab.records import Record

    rec = Record(key="k1", experiment="smoke", point="tiny", params={}, mode="measured",
                 status="ok", metrics={"losses": [6.2, 5.1, 4.0]},
                 config={"cluster": {"name": "local"}}, hardware={"device_name": "cpu"},
                 timestamp="2020-01-01T00:00:00+00:00")
    (tmp_path / "smoke").mkdir()
    (tmp_path / "smoke" / "points.jsonl").write_text(rec.to_json() + "\n")
    p = run_cli("+exp=smoke", "experiment.action=plot", f"experiment.results_dir={tmp_path}",
                f"hydra.run.dir={tmp_path / 'hydra'}")
    assert p.returncode == 0, p.stderr
    table = pd.read_csv(tmp_path / "smoke" / "table.csv")
    assert list(table["y_value"]) == [6.2, 5.1, 4.0] and set(table["kind"]) == {"measured"}
    # steps as the log numbers them: 1 = after the first update
    assert set(table["y_name"]) == {"loss"} and list(table["x_value"]) == [1, 2, 3]
    for ext in ("png", "pdf"):
        path = tmp_path / "smoke" / f"smoke.{ext}"
        assert path.stat().st_size > 1000
        path.unlink()
    q = subprocess.run([sys.executable, "-m", "experiments.plot", "smoke", "--results-dir",
                        str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr
    assert "\nresult:\n  " in q.stdout  # the experiment's conclude lines, as run.py prints them
    assert (tmp_path / "smoke" / "smoke.png").exists()
    assert json.loads((tmp_path / "smoke" / "points.jsonl").read_text())["key"] == "k1"


@pytest.mark.slow
def test_smoke_end_to_end(tmp_path):
    """python run.py +exp=smoke: 2 ranks (DP 2) train, the record says the loss went down."""
    p = run_cli("+exp=smoke", f"experiment.results_dir={tmp_path}", "train.progress=false",
                f"hydra.run.dir={tmp_path / 'hydra'}")
    assert p.returncode == 0, p.stdout + p.stderr
    rec = json.loads((tmp_path / "smoke" / "points.jsonl").read_text())
    assert rec["status"] == "ok" and rec["metrics"]["loss_decreased"] is True
    assert rec["topology"]["dp"] == 2 and rec["memory"] and rec["comm"]
    table = pd.read_csv(tmp_path / "smoke" / "table.csv")
    assert len(table) == 8 and set(table["kind"]) == {"measured"}
    assert (tmp_path / "smoke" / "smoke.png").exists()
    # re-running skips the done point
    q = run_cli("+exp=smoke", f"experiment.results_dir={tmp_path}", "train.progress=false",
                f"hydra.run.dir={tmp_path / 'hydra2'}")
    assert q.returncode == 0 and "1 already done here (reused, not run again: " \
        "experiment.force=true re-runs them), ran 0" in q.stdout


# ------------------------------------------------------------------ the config composed once
_COUNTING = """
import sys
import hydra
from zero_repro.lab import jobs, cli
calls = []
compose = jobs.compose
def counted(*a, **k):
    calls.append(k.get("overrides"))
    return compose(*a, **k)
jobs.compose = counted
def no_main(*a, **k):
    raise AssertionError("composed again through @hydra.main")
hydra.main = no_main
sys.argv = ["run.py"] + sys.argv[1:]
try:
    cli.main()
finally:
    print("COMPOSED", len(calls), file=sys.stderr)
"""


def test_each_job_is_composed_once_and_run_in_its_own_hydra_folder(tmp_path):
    """A two-job multirun composes its config twice in all (once per job, never again through
    ``@hydra.main``); each job runs in ``<sweep dir>/<num>`` with Hydra's files there, the
    point files the plan writes included."""
    env = dict(os.environ, ZERO_REPRO_HOME=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", _COUNTING, "-m", "+exp=smoke",
                        "experiment.action=plan", "train.seed=1,2",
                        f"experiment.results_dir={tmp_path / 'res'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert "COMPOSED 2" in p.stderr, p.stderr
    (sweep,) = glob.glob(str(tmp_path / "multirun" / "smoke" / "*"))
    assert sorted(os.listdir(sweep)) == ["0", "1", "multirun.yaml"]
    for num, seed in ((0, 1), (1, 2)):
        job = os.path.join(sweep, str(num))
        overrides = open(os.path.join(job, ".hydra", "overrides.yaml")).read()
        assert f"train.seed={seed}" in overrides
        saved = open(os.path.join(job, ".hydra", "config.yaml")).read()
        assert f"seed: {seed}" in saved and "hydra:" not in saved
        assert glob.glob(os.path.join(job, "points", "*.yaml")), os.listdir(job)
        assert os.path.isfile(os.path.join(job, "cli.log"))
    assert p.stdout.count("point file: ") == 2
    # a single job: one composition, the folder under outputs/
    p = subprocess.run([sys.executable, "-c", _COUNTING, "+exp=smoke", "experiment.action=plan",
                        f"experiment.results_dir={tmp_path / 'res'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and "COMPOSED 1" in p.stderr, p.stderr
    (run,) = glob.glob(str(tmp_path / "outputs" / "smoke" / "*"))
    assert os.path.isfile(os.path.join(run, ".hydra", "hydra.yaml"))
    assert glob.glob(os.path.join(run, "points", "*.yaml"))


def test_a_failed_job_does_not_stop_the_multirun_and_the_command_ends_with_it(tmp_path,
                                                                              monkeypatch):
    """``jobs.run``: job 0 fails (an exception, then a non-ok exit), job 1 still runs, and the
    command ends with the first failure; a usage error (exit 2) or Ctrl-C stops at once."""
    from zero_repro.lab import jobs

    monkeypatch.setattr(jobs, "configure_log", lambda *a, **k: None)  # leave pytest's logging
    schema.register_configs()
    overrides = [["+exp=smoke", f"train.seed={s}", f"hydra.sweep.dir={tmp_path}"]
                 for s in (1, 2)]

    def composed():
        with jobs.composing(conf_dir()):
            return [jobs.compose_job(o, n, True) for n, o in enumerate(overrides)]

    for failure, stops in ((RuntimeError("boom"), False), (SystemExit(1), False),
                           (SystemExit(2), True), (KeyboardInterrupt(), True)):
        ran = []

        def task(job):
            ran.append((job.num, os.getcwd(), job.output_dir))
            if job.num == 0:
                raise failure

        with pytest.raises(type(failure)) as e:
            jobs.run(composed(), task, multirun=True)
        assert e.value is failure
        assert [r[0] for r in ran] == ([0] if stops else [0, 1]), (failure, ran)
        assert all(r[2] == str(tmp_path / str(r[0])) for r in ran)
    assert sorted(os.listdir(tmp_path)) == ["0", "1", "multirun.yaml"]

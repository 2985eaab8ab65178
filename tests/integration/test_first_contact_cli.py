"""What a new user sees, through the real CLI: files go to the clone (or ZERO_REPRO_HOME), never
the working directory, from a sub-directory and from outside alike, and the clone stays clean;
`python run.py` alone lists the experiments (exit 2); a reused point says so with the re-run
setting, warns when it was measured on a loaded machine, and with `logging=wandb` is mirrored
from its record into the offline folder the README names, which W&B's own tools read; step and
summary lines put model states per rank beside Table 1; every run ends with result lines."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pandas as pd
import pytest

from zero_repro import config as C
from zero_repro import schema
from zero_repro import paths
from zero_repro.lab import cli
from zero_repro.lab import rank_log
from zero_repro.lab import records as R

REPO = str(paths.REPO_ROOT)
# what a clone holds that a run needs (results/paper: the paper's numbers the tables join)
CLONE_PARTS = ("zero_repro", "experiments", "conf", "run.py", "pyproject.toml", ".gitignore",
               "README.md", os.path.join("results", "paper"))


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "ZERO_REPRO_")) and k not in (
               "PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_ID",
               "SLURM_STEP_NUM_TASKS")}
    return {**env, "WANDB_SILENT": "true", **extra}


def _git(root, *args) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          check=True).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A clone of this working tree (its files committed in a fresh repository)."""
    root = tmp_path_factory.mktemp("clone") / "zero-repro"
    for part in CLONE_PARTS:
        src, dst = os.path.join(REPO, part), root / part
        if os.path.isdir(src):
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "clone")
    return root


def _run(clone_root, cwd, *args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(str(clone_root), "run.py"), *args],
                          cwd=str(cwd), capture_output=True, text=True, timeout=300,
                          env=_env(**env))


SMOKE = ("+exp=smoke", "train.steps=3", "train.progress=false")


def test_runs_from_a_subdirectory_and_from_outside_leave_the_clone_clean(clone, tmp_path):
    """A real point from ``experiments/``; the same command from outside the clone with
    ``logging=wandb`` reuses it (the record made to look loaded): the reuse is said, with the
    re-run setting and the load; the reused point is mirrored into
    ``results/local/wandb/offline-run-*``, which ``wandb sync`` and ``wandb leet`` read; nothing
    lands in either working directory and ``git status`` of the clone stays empty."""
    sub = clone / "experiments"
    before = sorted(os.listdir(sub))
    p = _run(clone, sub, *SMOKE)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(os.listdir(sub)) == before, "the run wrote into its working directory"
    assert _git(clone, "status", "--porcelain") == ""
    store = R.RecordStore.for_experiment(str(clone / "results" / "local"), "smoke")
    (rec,) = store.load()
    assert rec.status == "ok" and glob.glob(str(clone / "outputs" / "smoke" / "*"))
    assert {"loadavg_start", "loadavg_end", "cpus"} <= set(rec.load)
    # the step and summary lines: model states per rank beside Table 1 (stage 0: 16Ψ)
    log = p.stdout + p.stderr
    assert "model states" in log and "(Table 1 16Ψ: " in log and "x Table 1 (16Ψ, Ψ " in log
    assert "result:" in p.stdout and "loss" in p.stdout.split("result:")[1]

    # measured while others took 90% of the CPU
    store.put(R.Record.from_dict({**json.loads(rec.to_json()), "load": {
        **rec.load, "others_share": 0.9, "own_share": 0.1, "busy_share": 1.0}}),
        replace_ok=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    q = _run(clone, outside, *SMOKE, "logging=wandb")
    assert q.returncode == 0, q.stdout + q.stderr
    assert list(outside.iterdir()) == [], "the run wrote into its working directory"
    assert _git(clone, "status", "--porcelain") == ""
    out = q.stdout + q.stderr
    assert "1 already done here (reused, not run again: experiment.force=true re-runs" in out
    assert "other processes took 90% of the machine's CPU time" in out
    assert "experiment.force=true re-measures it" in out
    assert "W&B: 1 reused point(s) mirrored from their records" in out
    folder = clone / "results" / "local" / "wandb"
    assert f"wandb sync {folder}" in out  # the upload line names the folder
    (run_dir,) = glob.glob(str(folder / "offline-run-*"))

    wandb_exe = os.path.join(os.path.dirname(sys.executable), "wandb")
    dry = subprocess.run([wandb_exe, "sync", "--dry-run", str(folder)], capture_output=True,
                         text=True, timeout=120, cwd=str(tmp_path), env=_env(WANDB_MODE="offline"))
    assert dry.returncode == 0 and "Would sync 1 run" in dry.stdout + dry.stderr, dry
    leet = subprocess.run([wandb_exe, "leet", "inspect", "--json", run_dir],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                          env=_env(WANDB_MODE="offline"))
    assert leet.returncode == 0, leet.stderr
    docs = [json.loads(line) for line in leet.stdout.splitlines() if line.strip()]
    (run,) = [d["run"] for d in docs if d.get("type") == "run"]
    config = run["config"]["update"]
    assert config["reused"] is True and config["measured_in_sweep"] == rec.sweep_id
    history = [d["history"]["item"] for d in docs if d.get("type") == "history"]
    assert [h["loss"] for h in history] == pytest.approx(rec.metrics["losses"])


def test_bare_run_py_lists_the_experiments_and_exits_2(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(REPO, "run.py")], cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 2
    assert "smoke " in p.stdout and "fig3_scaling " in p.stdout
    assert "python run.py +exp=smoke" in p.stdout
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: no experiment")
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


# --------------------------------------------------------------------------- where files go
def test_home_is_the_checkout_or_zero_repro_home_or_a_documented_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(paths.HOME_ENV, raising=False)
    assert paths.home() == paths.REPO_ROOT  # this checkout
    assert paths.results_path("results/local") == paths.REPO_ROOT / "results" / "local"
    assert paths.results_path("results") == paths.RESULTS_DIR
    monkeypatch.chdir(tmp_path)
    assert paths.results_path("mine") == tmp_path / "mine"  # the user's own, as given
    # an installed package: no repository around it
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path / "site-packages")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert not paths.is_checkout() and paths.home() == tmp_path / "h" / "zero_repro"
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "z"))
    assert paths.results_path("results/local") == tmp_path / "z" / "results" / "local"


def test_hydra_folders_and_results_dir_resolve_under_home(monkeypatch, tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path))
    schema.register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=cli.conf_dir(), version_base="1.3"):
        d = compose("config", overrides=["+exp=smoke"], return_hydra_config=True)
        assert str(d.hydra.run.dir).startswith(str(tmp_path / "outputs" / "smoke"))
        assert str(d.hydra.sweep.dir).startswith(str(tmp_path / "multirun" / "smoke"))
        cfg = schema.to_config(_without_hydra(d))
    GlobalHydra.instance().clear()
    assert cfg.experiment.results_dir == str(tmp_path / "results" / "local")


def _without_hydra(d):
    from omegaconf import open_dict

    with open_dict(d):
        del d["hydra"]
    return d


# ------------------------------------------------------------------------ the memory line
def _cfg(stage: int, dtype: str = "fp32", world: int = 2) -> C.Config:
    cfg = C.Config()
    cfg.parallel.world_size, cfg.parallel.tp = world, 1
    cfg.zero.stage, cfg.zero.dtype = stage, dtype
    return cfg


def test_table1_value_follows_stage_dp_and_precision():
    s0, s3 = rank_log.table1_model_states(_cfg(0)), rank_log.table1_model_states(_cfg(3))
    assert s0["bytes"] / s3["bytes"] == 2  # 16Ψ vs 16Ψ/N_d at N_d = 2
    assert (s0["formula"], s3["formula"]) == ("16Ψ", "16Ψ/N_d")
    psi = s0["psi"]
    assert rank_log.table1_model_states(_cfg(1, "bf16"))["bytes"] == 4 * psi + 12 * psi / 2
    assert rank_log.table1_model_states(_cfg(2, "fp32"))["bytes"] == 4 * psi + 12 * psi / 2
    assert rank_log.table1_model_states(_cfg(1, "fp32"))["formula"] == "8Ψ+8Ψ/N_d"


def test_memory_text_puts_buffers_and_gathered_params_apart():
    ledger = {"params_lp": 4 << 20, "grads": 4 << 20, "adam_m": 4 << 20, "adam_v": 4 << 20,
              "master_fp32": 0, "comm_buffers": 2 << 20, "params_gathered": 8 << 20}
    parts = rank_log.memory_parts(ledger)
    assert parts == {"states": 16 << 20, "buffers": 2 << 20, "gathered": 8 << 20, "other": 0}
    t1 = {"bytes": 16 << 20, "formula": "16Ψ/N_d", "psi": 1, "n_d": 2}
    assert rank_log.memory_text(parts, t1) == ("model states 16 MiB/rank (Table 1 16Ψ/N_d: 16), "
                                               "buffers 2 MiB, gathered params 8 MiB")
    assert "= 1.000 x Table 1 (16Ψ/N_d, Ψ 1, N_d 2: 16)" in rank_log.memory_text(parts, t1,
                                                                                  long=True)


# -------------------------------------------------------------------------- machine load
def test_a_record_window_measures_its_own_and_the_machines_cpu_time():
    start = R.load_snapshot()
    stop = time.perf_counter() + 1.2
    while time.perf_counter() < stop:  # this process busy for the window
        sum(i * i for i in range(1000))
    load = R.load_between(start)
    assert load["wall_s"] >= 1.2 and load["cpus"] >= 1
    assert 0 < load["own_share"] <= load["busy_share"] + 0.05
    assert 0 <= load["others_share"] <= 1
    assert "others_share" not in R.load_between(R.load_snapshot())  # too short to tell


def test_heavy_load_judges_other_processes_share_or_else_the_load_average():
    quiet = {"cpus": 2, "loadavg_start": 3.0, "loadavg_end": 3.0, "others_share": 0.1}
    assert R.heavy_load(quiet) == ""  # a high load average of our own ranks is no load
    assert "62%" in R.heavy_load({**quiet, "others_share": 0.62})
    assert R.heavy_load({"cpus": 2, "loadavg_start": 1.0, "loadavg_end": 1.5}) == ""
    assert "load average was 4" in R.heavy_load({"cpus": 2, "loadavg_start": 4.0,
                                                 "loadavg_end": 1.0})
    assert R.heavy_load({}) == ""  # older records: nothing known, nothing said


def test_reusing_a_loaded_measured_point_warns_with_the_rerun_setting(tmp_path, caplog):
    from tests.integration.test_first_contact import Counting
    from zero_repro.lab import sweep

    cfg = C.Config()
    cfg.experiment.name, cfg.experiment.results_dir = "count", str(tmp_path)
    cfg.train.progress = False
    sweep.run_sweep(cfg, Counting())
    store = R.RecordStore.for_experiment(str(tmp_path), "count")
    for r in store.load():
        store.put(R.Record.from_dict({**json.loads(r.to_json()), "load": {
            "cpus": 2, "loadavg_start": 5.0, "loadavg_end": 5.0, "others_share": 0.7}}),
            replace_ok=True)
    with caplog.at_level("INFO"):
        res = sweep.run_sweep(cfg, Counting())
    assert len(res.reused) == 2 and not res.records
    warned = [m for m in caplog.messages if "took 70%" in m]
    assert len(warned) == 1 and "experiment.force=true re-measures it" in warned[0]  # measured
    assert any("2 already done (reused; experiment.force=true re-runs them)" in m
               for m in caplog.messages)


# ---------------------------------------------------------------------------- result lines
def test_result_lines_come_from_the_hook_else_a_default(tmp_path, capsys):
    table = pd.DataFrame({"figure": "f", "series": ["a", "a", "b"], "x_name": "x",
                          "x_value": [1, 2, 1], "y_name": "y", "y_value": [1.0, 3.0, 2.0],
                          "unit": "u", "kind": "measured"})
    table.to_csv(tmp_path / "t.csv", index=False)
    out = {"table": str(tmp_path / "t.csv"), "rows": 3, "records": 2, "figures": []}

    class Hooked:
        @staticmethod
        def conclude(t):
            return [f"{len(t)} rows"]

    cli.print_outputs(out, Hooked())
    assert capsys.readouterr().out.endswith("result:\n  3 rows\n")
    cli.print_outputs(out, object())
    text = capsys.readouterr().out
    assert "measured a: y 1 .. 3 u (2 points)" in text and "measured b: y 2 u (1 point)" in text

    class Broken:
        @staticmethod
        def conclude(t):
            raise KeyError("y_value")

    cli.print_outputs(out, Broken())  # falls back: the figure is written already
    assert "measured a: y 1 .. 3 u" in capsys.readouterr().out


def test_committed_tables_conclude_in_a_few_lines():
    import experiments.fig5_convergence as fig5
    import experiments.table1_memory as table1

    t1 = table1.conclude(pd.read_csv(paths.RESULTS_DIR / "table1_memory" / "table.csv"))
    assert t1[0].startswith("analytic: 46 of 54 cells equal the paper's printed value; 8 differ")
    assert "12 of 12 ledgers equal Table 1's formula to the byte" in t1[1]
    assert "Pos+g+p / baseline = 0.250 (1/N_d = 0.250)" in t1[2]
    f5 = fig5.conclude(pd.read_csv(paths.RESULTS_DIR / "fig5_convergence" / "table.csv"))
    assert any(line.startswith("fp32: 8 of 8 series follow stage 0 fp32 within 1e-05")
               for line in f5)
    assert all(len(line) < 200 for line in t1 + f5) and len(t1 + f5) <= 8


def test_smoke_concludes_losses_coinciding_curves_and_model_states():
    import experiments.smoke as smoke

    rows = []
    for stage, mib in ((0, 2.0), (3, 1.0)):
        for step, loss in ((1, 6.0), (2, 5.0)):
            rows.append({"figure": "smoke", "series": f"GPT fp32 stage {stage} 8 steps, x data",
                         "x_name": "step", "x_value": step, "y_name": "loss", "y_value": loss,
                         "unit": "nats", "kind": "measured", "model_state_MiB": mib,
                         "table1_MiB": mib, "table1_formula": "16Ψ" if stage == 0 else "16Ψ/N_d"})
    lines = smoke.conclude(pd.DataFrame(rows))
    assert lines[0] == ("stage 0: loss 6.000 -> 5.000 over steps 1-2 (falls); model states "
                        "2 MiB/rank, Table 1 16Ψ: 2 MiB")
    assert lines[1].endswith("model states 1 MiB/rank, Table 1 16Ψ/N_d: 1 MiB")
    assert lines[2] == "same loss curve (|Δloss| <= 1e-6 at every step): stage 0, stage 3"


# ------------------------------------------------------------------------------ plan lines
def test_plan_lines_are_short_and_verbose_lists_the_overrides(tmp_path, capsys):
    schema.register_configs()
    ((cfg, experiment, plan),) = cli.check_args([
        "+exp=table1_memory", "experiment.action=plan", f"experiment.results_dir={tmp_path}",
        f"hydra.run.dir={tmp_path / 'hydra'}"])
    cli.print_plan(cfg, experiment, plan)
    short = capsys.readouterr().out.splitlines()
    points = [ln for ln in short if ln.startswith("  ")]
    assert len(points) == 4 and all(len(ln) < 120 for ln in points)
    assert "each point's config overrides: experiment.verbose=true" in short
    cfg.experiment.verbose = True
    cli.print_plan(cfg, experiment, plan)
    assert "parallel.world_size=2" in capsys.readouterr().out



def test_fig3_concludes_speedups_against_the_paper_and_the_ideal():
    import experiments.fig3_scaling as fig3

    table = pd.read_csv(paths.RESULTS_DIR / "fig3_scaling" / "table.csv")
    lines = fig3.conclude(table)
    sim = table[(table["kind"] == "simulated") & (table["y_name"] == "speedup")]
    predicted = sim[~sim["series"].str.contains("(paper batch)", regex=False)]
    first = predicted.iloc[0]
    assert lines[0].startswith("simulated, predicted batch: TFLOPs/GPU")
    assert "paper 25.65 37.55 39.04 36.59" in lines[0]
    assert lines[1].startswith("aggregate speed-up, predicted batch / paper (ideal):")
    assert (f"{first['x_value']} {first['y_value']:.2f}x / {first['paper_value']:.2f}x (2)"
            in lines[1])
    assert lines[2].startswith("simulated, paper batch:") and "paper batch / paper" in lines[3]
    # the figure's conclusion (does memory make the step super-linear?) and its sensitivity
    concl = [ln for ln in lines if ln.startswith("conclusion: ")]
    assert len(concl) == 2 and "Table 6's 16" in concl[0]
    assert f"{first['y_value']:.2f}x at the predicted batches" in concl[1]
    assert [ln.split(",")[1] for ln in lines if ln.startswith("sensitivity, ")] == [" C4", " C5"]
    ups = table[(table["kind"] == "measured") & (table["y_name"] == "speedup")]
    assert f"1->2 ranks {ups['y_value'].iloc[0]:.2f}x (ideal 2)" in lines[-1]
    assert lines[-1].startswith("measured") and all(len(line) < 200 for line in lines)


def test_a_plan_of_many_points_gives_one_sbatch_line_per_shape(tmp_path, capsys):
    schema.register_configs()
    ((cfg, experiment, plan),) = cli.check_args([
        "+exp=fig5_convergence", "experiment.action=plan", f"experiment.results_dir={tmp_path}",
        f"hydra.run.dir={tmp_path / 'hydra'}"])
    cli.print_plan(cfg, experiment, plan)
    out = capsys.readouterr().out.splitlines()
    (line,) = [ln for ln in out if ln.startswith("point file")]
    assert line.startswith(f"point files: {len(plan.todo)} (the keys above), each: sbatch ")
    assert line.endswith("<key>.yaml")
    files = os.listdir(os.path.join(cfg.experiment.results_dir, "fig5_convergence", "runs",
                                    "plan"))
    assert len(files) == len(plan.todo)  # every file is still written
    cfg.experiment.verbose = True
    cli.print_plan(cfg, experiment, plan)
    assert sum(ln.startswith("point file: sbatch") for ln in
               capsys.readouterr().out.splitlines()) == len(plan.todo)


def test_peers_concludes_per_stage_ratios_and_equivalence():
    import experiments.peers as peers

    table = pd.read_csv(paths.RESULTS_DIR / "peers" / "table.csv")
    lines = peers.conclude(table)
    newest = (table.sort_values("measured_at", kind="stable")
              .drop_duplicates(["table", "model", "x_value", "y_name"], keep="last"))

    def value(tbl: str, framework: str, y_name: str) -> float:
        r = newest[(newest["table"] == tbl) & (newest["x_value"] == framework)
                   & (newest["y_name"] == y_name)]["y_value"]
        assert len(r) == 1
        return float(r.iloc[0])

    same = next(line for line in lines if line.startswith("same_kernel, gpt_20m: "))
    assert f"s3 {value('same_kernel', 'zero_repro_s3', 'ratio_to_best_peer'):.2f} " in same
    assert "zero_repro / lower bound" in same
    mem = next(line for line in lines if line.startswith("memory, gpt_20m: "))
    assert f"s2 {value('memory', 'zero_repro_s2', 'memory_to_best_peer'):.2f} (" in mem
    budget = next(line for line in lines if line.startswith("budget: "))
    assert f"s3 {value('budget', 'zero_repro_s3', 'max_params_in_budget') / 1e6:.1f}M" in budget
    tol = newest[newest["y_name"] == "tolerance_ratio"]["y_value"].max()
    assert lines[-1].startswith(f"equivalence: largest tolerance ratio {tol:.3f}")
    assert len(lines) <= 6 and all(len(line) < 240 for line in lines)


def test_default_result_lines_name_the_source_not_the_hardware():
    assert cli.short_series("local DP 2 · this machine: AMD EPYC (2 cores)") == \
        "local DP 2 (this machine)"
    assert cli.short_series("x" * 200).endswith("...") and len(cli.short_series("x" * 200)) == 90

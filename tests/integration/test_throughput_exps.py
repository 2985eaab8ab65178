"""Throughput figures 2, 3, 4, 8 (experiments/fig*_*.py): plans for the local default and for
the paper's cluster, the simulated paper-scale rows (names, values = the calibrated model,
Fig 3's super-linear step, Fig 2's fit quality), one real local measured point end to end, and
the GPU script (skipped without CUDA; without it the script must refuse clearly)."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from tests import REPO
from zero_repro.scale.paper import table9
from zero_repro.lab.figures import paper_compare
from zero_repro.lab import registry as base
from zero_repro import config as C
from zero_repro import schema
from zero_repro import validation
from zero_repro.lab import sweep as orchestrate
from zero_repro.lab.cli import conf_dir
from zero_repro.lab.throughput import batch as TB
from zero_repro.lab.throughput import setups as TN
from zero_repro.scale.paper.clusters import load_cluster
from zero_repro.scale.paper.setups import setups
from zero_repro.scale.paper.table3 import zero_overrides
from zero_repro.scale import calibrate

EXPS = {"fig2_throughput": "fig2", "fig3_scaling": "fig3", "fig4_dp_only": "fig4",
        "fig8_configs": "fig8"}
PREDICT = {"fig2": calibrate.predict_fig2, "fig3": calibrate.predict_fig3,
           "fig4": calibrate.predict_fig4, "fig8": calibrate.predict_fig8}


def make_cfg(name: str, *overrides: str) -> C.Config:
    schema.register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        dcfg = compose("config", overrides=[f"+exp={name}", *overrides])
    return validation.validate(schema.to_config(dcfg))


_PLANS: dict = {}


# quick variants: predicted batches judged by the closed-form memory model (the dry-run search
# is its own test), Fig 3's local budget searched on the tiny model
QUICK = ("++experiment.params.sim_judge=analytic", "++experiment.params.local_model=tiny")


def planned(name: str, *overrides: str):
    """orchestrate.plan of an experiment, cached per command line (planning validates every
    point's config through OmegaConf: seconds for Fig 2's 25 points)."""
    key = (name, overrides)
    if key not in _PLANS:
        ov = [o for o in QUICK if o.split("=")[0][2:] not in " ".join(overrides)]
        _PLANS[key] = orchestrate.plan(make_cfg(name, *ov, *overrides), base.get(name))
    return _PLANS[key]


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("results"))


def by_role(planned, role):
    return [pp for pp in planned if pp.point.params.get("role") == role]


@pytest.mark.parametrize("name", [n if n == "fig8_configs" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(EXPS)])  # one in the default suite
def test_plans_local_and_paper_cluster(name, results_dir):
    fig = EXPS[name]
    n = len(setups(fig))
    local = planned(name, f"experiment.results_dir={results_dir}")
    assert len(by_role(local, "calibration")) == 1
    sims = by_role(local, "simulated")  # one series at the predicted batch, one at the paper's
    assert len(sims) == 2 * n and not by_role(local, "measured_paper")
    assert sorted(pp.point.params["batch_rule"] for pp in sims) == ["max_fit"] * n + ["paper"] * n
    loc = by_role(local, "measured_local")
    if fig == "fig8":  # C1-C5 coincide at DP 1 or TP 1: no local panel on 2 ranks
        assert not loc
    else:
        assert loc and all(pp.cfg.cluster.name == "local" and pp.cfg.parallel.world_size <= 2
                           for pp in loc)
    for pp in by_role(local, "simulated"):  # paper scale on the paper's cluster
        assert pp.cfg.cluster.name == "dgx2_v100" and pp.cfg.model.seq_len == 1024
    cluster = planned(name, "cluster=dgx2_v100", "launcher=slurm")
    real = by_role(cluster, "measured_paper")
    assert not by_role(cluster, "measured_local") and len(real) == n
    for pp, s in zip(real, setups(fig)):
        c = pp.cfg
        assert (c.parallel.world_size, c.parallel.tp, c.train.micro_batch_size) == (
            s.gpus, s.tp, s.batch_per_gpu)
        assert (c.model.n_layer, c.model.n_embd, c.model.n_head) == (s.n_layer, s.hidden, s.heads)
        assert pp.point.mode == "measured" and pp.nodes == math.ceil(s.gpus / 16)
        assert c.zero.stage == (0 if s.series == "Baseline" else
                                zero_overrides(pp.point.params["zero_config"])["zero.stage"])
        assert c.zero.dtype == "fp16" and c.zero_r.activation_checkpointing


_SIM: dict = {}


def _simulated_records(name, results_dir):
    if name in _SIM:
        return _SIM[name]
    exp = base.get(name)
    recs = []
    for pp in planned(name, f"experiment.results_dir={results_dir}"):
        if pp.point.mode == "simulated":
            recs.append(orchestrate.run_and_record(exp, pp, "test"))
    _SIM[name] = exp, recs
    return exp, recs


@pytest.mark.parametrize("name", sorted(EXPS))
def test_simulated_rows_names_and_values(name, results_dir):
    fig = EXPS[name]
    exp, recs = _simulated_records(name, results_dir)
    assert all(r.status == "ok" for r in recs), [r.reason for r in recs]
    rows = [r for r in exp.summarize(recs) if r["y_name"] == TN.Y_NAME]
    assert rows and {(r["figure"], r["x_name"], r["unit"], r["kind"]) for r in rows} == {
        (fig, TN.X_NAME[fig], "TFLOPs/GPU", "simulated")}
    # at the paper's batch the per-point simulation is the calibrated model's prediction
    # (incl. Fig 4's DDP overlap)
    paper = [r for r in rows if r["batch_rule"] == "paper"]
    ours = sorted(r["y_value"] for r in paper)
    theirs = sorted(r["y_value"] for r in PREDICT[fig](calibrate.calibration("dgx2_v100")))
    assert ours == pytest.approx(theirs, rel=1e-9)
    assert all("dgx2_v100" in r["hardware"] and r["batch_source"].startswith("paper")
               and r["series"].endswith(TN.PAPER_BATCH) for r in paper)
    # at the predicted batch: the largest on the grid that fits, named without the suffix
    pred = [r for r in rows if r["batch_rule"] == "max_fit"]
    assert len(pred) == len(paper) and all(not r["series"].endswith(TN.PAPER_BATCH)
                                           and r["batch_source"].startswith("max_fit")
                                           for r in pred)
    from zero_repro.scale.dryrun.maxsize import BATCH_GRID
    assert all(r["batch_per_gpu"] in BATCH_GRID or r["batch_per_gpu"] == 0 for r in pred)
    # calibration written to results/calibration with the fitted values and the fit error
    files = os.listdir(os.path.join(results_dir, "calibration"))
    assert any(f.endswith(".json") for f in files) and any(f.endswith(".csv") for f in files)


def test_fig3_superlinear_and_fig2_fit(results_dir):
    exp3, recs3 = _simulated_records("fig3_scaling", results_dir)
    rows = exp3.summarize(recs3)
    pb = TN.PAPER_BATCH
    sp = {r["x_value"]: r["y_value"] for r in rows if r["y_name"] == "speedup"
          and r["series"].endswith(pb)}
    assert sp["64->128"] > 2.0  # the super-linear step at the paper's batches, predicted
    agg = {r["x_value"]: r["y_value"] for r in rows if r["y_name"] == TN.AGG_NAME
           and r["series"] == exp3.AGG + pb}
    per = {r["x_value"]: r["y_value"] for r in rows if r["y_name"] == TN.Y_NAME
           and r["series"] == exp3.BARS + pb}
    assert agg[128] == pytest.approx(per[128] * 128)
    exp2, recs2 = _simulated_records("fig2_throughput", results_dir)
    ref = paper_compare.load_reference()
    table = paper_compare.compare(pd.DataFrame(exp2.summarize(recs2)), ref,
                                  exp2.SERIES_FAMILY)
    zero = table[(table["series"] == exp2.ZERO + pb) & (table["y_name"] == TN.Y_NAME)]
    assert len(zero) == 9 and zero["rel_error_vs_paper"].notna().all()
    assert zero["rel_error_vs_paper"].abs().max() <= 0.23  # the fit's bound (test_perf_model)
    assert all(zero["in_sample"].str.contains("calibration point"))  # marked in-sample
    base_rows = table[table["series"].isin([exp2.BASE_IN + pb, exp2.BASE_OUT + pb])]
    assert base_rows["paper_value"].notna().sum() == 9  # both baseline series joined
    # the speed-up bars of both series, joined to the paper's, never marked in-sample
    for sfx in ("", pb):
        bars = table[table["series"] == exp2.SPEEDUP + sfx]
        assert len(bars) == 9 and bars["paper_value"].notna().all()
        assert not bars["in_sample"].astype(bool).any()
    full = pd.concat([table, paper_compare.paper_rows(ref, "fig2")], ignore_index=True)
    lines = exp2.error_lines(full)
    assert "FITTED" in lines[0] and "baseline (predicted)" in lines[0] and "mean" in lines[1]


def test_fig8_in_sample_point_and_bar_labels(results_dir):
    """Fig 8's 170B C5 point at the paper's batch is Fig 2's fitted 170B point (in-sample);
    every bar says its batch, the paper-batch 60B bars their Table 9 row."""
    exp, recs = _simulated_records("fig8_configs", results_dir)
    rows = [r for r in exp.summarize(recs) if r["y_name"] == TN.Y_NAME]
    inside = [r for r in rows if r["in_sample"]]
    assert [(r["x_value"], r["batch_per_gpu"], r["batch_rule"]) for r in inside] == [
        ("C5", 12, "paper")] and "fig2 170B" in inside[0]["in_sample"]
    c4 = next(r for r in rows if r["x_value"] == "C4" and r["batch_rule"] == "paper")
    assert c4["bar_label"] == "b32, T9 row 3"
    assert all(r["bar_label"].startswith("b") if r["batch_per_gpu"] else
               r["bar_label"] == f"{r['series'].split(' (')[0]}: does not fit (OOM at b1)"
               for r in rows)


def test_fig8_local_panel_needs_dp_and_tp_of_two():
    """C1-C5 differ only with a DP degree (P_os, P_os+g) and an MP degree (P_a) of 2 or more:
    a local world where either is 1 is refused at planning; world 4 = TP 2 x DP 2 plans."""
    exp = base.get("fig8_configs")
    p = dict(TN.DEFAULTS, local_configs=["C1", "C4"], local_model="tiny", local_batch=4)
    with pytest.raises(ValueError, match="DP >= 2 and TP >= 2"):
        exp._local(None, {**p, "local_world": 2, "local_tp": 2})
    pts = exp._local(None, {**p, "local_world": 4, "local_tp": 2})
    assert [(q.overrides["parallel.world_size"], q.overrides["parallel.tp"]) for q in pts] == [
        (4, 2), (4, 2)]


def test_fig4_local_zero_dp_fits_a_deeper_model_in_the_baselines_budget():
    """Figure 4's mechanism at CPU scale: in the per-rank memory the baseline (stage 0) needs
    at its own depth, P_os+g at DP 2 fits a deeper model of the same shape (memory dry run)."""
    budget = TB.local_budget("gpt_20m", 2, 1, "baseline", 4)
    n_base = TB.local_max_layers("gpt_20m", 2, 1, "baseline", budget, 4)
    n_zero = TB.local_max_layers("gpt_20m", 2, 1, "C3", budget, 4)
    assert n_base >= schema.model_conf("gpt_20m")["n_layer"]
    assert n_zero > n_base


def test_max_batch_search_by_dry_run():
    """maxsize.max_batch: the answer fits, the next grid batch does not, each judged batch
    carries the capacity it needs (so the answer at another capacity can be read off)."""
    from zero_repro.scale.dryrun import maxsize
    cfg = TB._local_dryrun_config("small", 2, 1, "C3")
    grid = (1, 2, 4, 8, 16)
    need = {b: maxsize.max_batch(cfg, capacity=float(1 << 50), seed=b, grid=(b,))
            .judgements[0].min_capacity for b in (4, 16)}
    assert need[16] > need[4]
    res = maxsize.max_batch(cfg, capacity=float(need[4]), seed=1, grid=grid)
    j = {x.batch: x for x in res.judgements}
    nxt = grid[grid.index(res.batch) + 1]
    assert res.batch >= 4 and j[res.batch].fits and not j[nxt].fits
    assert res.next_capacity() == j[nxt].min_capacity > need[4] >= j[res.batch].min_capacity
    down = maxsize.max_batch(cfg, capacity=float(need[4]), seed=16, grid=grid)  # walks down
    assert down.batch == res.batch


def test_max_fit_batches_grow_with_dp():
    p = dict(TN.DEFAULTS, batch="max_fit", max_fit_judge="analytic")
    v100 = load_cluster("dgx2_v100")
    s64, s128 = setups("fig3")[:2]
    b64, src = TB.max_fit_batch(s64, "C4", v100, p)
    b128, _ = TB.max_fit_batch(s128, "C4", v100, p)
    assert 0 < b64 < b128 and "analytic" in src
    lp = dict(TN.DEFAULTS, local_batch="max_fit")
    assert TB.local_batch("small", 1, 1, "C3", lp)[0] < TB.local_batch("small", 2, 1, "C3", lp)[0]
    assert TB.largest_true(lambda b: b <= 37) == 37 and TB.largest_true(lambda b: False) == 0


@pytest.mark.slow
def test_cli_plan_paper_cluster_prints_real_points(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "+exp=fig3_scaling",
                           "cluster=dgx2_v100", "launcher=slurm", "experiment.action=plan"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if " measured " in ln]
    assert len(lines) == 4
    for gpus, ln in zip((64, 128, 256, 400), lines):
        assert f"world={gpus} " in ln and "tp=16" in ln and f"nodes={math.ceil(gpus / 16)} " in ln


def test_local_measured_point_end_to_end(tmp_path):
    """One real tiny point (Fig 3's analogue, stage 2 + C3, one gloo rank: the cheapest spawn)
    through plan, run_point, the record store and summarize."""
    cfg = make_cfg("fig3_scaling", f"experiment.results_dir={tmp_path}", "train.steps=3",
                   "experiment.params.local_model=tiny", "experiment.params.local_worlds=[1]",
                   "experiment.params.local_repeats=1")
    exp = base.get("fig3_scaling")
    (pp,) = [pp for pp in orchestrate.plan(cfg, exp)
             if pp.point.params.get("role") == "measured_local"]
    assert pp.cfg.zero.stage == 2 and pp.cfg.zero_r.activation_checkpointing
    # the largest batch that fits the budget world 1 needs at the base batch: at least that
    # batch (a tiny model's larger batches can fit inside the allocator's rounding)
    assert pp.cfg.train.micro_batch_size >= 4
    rec = orchestrate.run_and_record(exp, pp, "test")
    assert rec.status == "ok", rec.reason
    assert rec.metrics["tflops_per_gpu"] > 0
    assert rec.metrics["aggregate_tflops"] == pytest.approx(rec.metrics["tflops_per_gpu"])
    rows = exp.summarize([rec])
    per = [r for r in rows if r["y_name"] == exp.TOKENS]
    assert len(per) == 1 and per[0]["kind"] == "measured" and per[0]["x_value"] == 1
    assert per[0]["y_value"] == pytest.approx(rec.metrics["tokens_per_s"])
    assert "CPU ranks" in per[0]["hardware"] and "memory dry run" in per[0]["batch_source"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPS))
def test_cli_runs_each_experiment_locally(name, tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), f"+exp={name}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "results" / name / "table.csv").exists()


def test_table9_row_order_is_explicit_and_selectable():
    """Table 9 prints batches 2, 4, 32, 32, 8 without names; Table 7's order (C1, C2, C4, C5,
    C3) is the default: C3 (no P_a) at batch 32 would need 40 GB of checkpoints at 60B."""
    rows = setups("fig8")
    assert table9.DEFAULT_ORDER == "table7"
    assert table9.batch_by_config(rows) == {"C1": 2, "C2": 4, "C3": 8, "C4": 32, "C5": 32}
    assert table9.batch_by_config(rows, "c1_to_c5") == {"C1": 2, "C2": 4, "C3": 32, "C4": 32,
                                                        "C5": 8}
    s170 = [s for s in table9.remap(rows) if s.size_label == "170B"]
    assert [(s.zero_config, s.batch_per_gpu) for s in s170] == [("C5", 12)]
    assert 2 * 32 * 1024 * 8192 * 75 > 32e9 > 2 * 8 * 1024 * 8192 * 75
    with pytest.raises(ValueError):
        table9.remap(rows, "by_size")
    assert {s.zero_config: s.batch_per_gpu for s in TN.figure_setups("fig8", {})
            if s.size_label == "60B"}["C3"] == 8


def test_points_and_records_resolve_setups_under_their_table9_order():
    """A Figure 8 point is read back (simulate, summaries) under the row mapping that planned
    it: "60B C3" is the batch-8 row under the default Table 7 order, the batch-32 row under
    c1_to_c5; only a non-default order enters a point's params (committed keys unchanged)."""
    ser = next(s.series for s in setups("fig8"))
    assert TN.find_setup("fig8", "60B C3", ser).batch_per_gpu == 8
    assert TN.find_setup("fig8", "60B C3", ser, {"table9_order": "c1_to_c5"}).batch_per_gpu == 32
    assert TN.find_setup("fig8", "60B C5", ser).batch_per_gpu == 32
    assert TN.order_params("fig8", {}) == {}
    assert TN.order_params("fig8", {"table9_order": "c1_to_c5"}) == {"table9_order": "c1_to_c5"}
    assert TN.order_params("fig4", {"table9_order": "c1_to_c5"}) == {}
    sims = by_role(planned("fig8_configs", "+experiment.params.table9_order=c1_to_c5"),
                   "simulated")
    c3 = next(pp.point for pp in sims if pp.point.params["setup"] == "60B C3")
    assert c3.params["table9_order"] == "c1_to_c5"
    assert all("table9_order" not in pp.point.params
               for pp in by_role(planned("fig8_configs"), "simulated"))

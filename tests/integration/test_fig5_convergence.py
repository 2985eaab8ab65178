"""Figure 5 analogue (experiments/fig5_convergence/): the plan covers stages 0-3, C1-C5 and the
fp16/bf16 variants on one TP x DP grid and composes through Hydra; summarize turns records into
loss / |dloss| / max-|dloss| rows against the stage 0 fp32 run; the plot draws the paper's
Fig. 5 only as labelled context; and a real 2-point run gives coinciding fp32 losses."""
from __future__ import annotations

import functools
import math
import os

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from experiments.fig5_convergence import figure as CF
from zero_repro.lab.figures import regenerate as plot
from zero_repro.lab import registry as base
from experiments import fig5_convergence as F
from zero_repro import config as C
from zero_repro import schema
from zero_repro import validation
from zero_repro.lab import sweep as orchestrate
from zero_repro.lab.cli import conf_dir
from zero_repro.lab.records import Record

NAME = "fig5_convergence"


def make_cfg(*overrides: str) -> C.Config:
    schema.register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        dcfg = compose("config", overrides=[f"+exp={NAME}", *overrides])
    return validation.validate(schema.to_config(dcfg))


def test_plan_composes_and_covers_stages_configs_dtypes():
    cfg = make_cfg()
    assert cfg.model.name == "tiny" and cfg.train.data == "pystdlib"
    planned = orchestrate.plan(cfg, base.get(NAME))  # validates every point's config
    runs = {(pp.point.params["config"], pp.cfg.zero.dtype): pp.cfg for pp in planned}
    fp32 = {c for c, d in runs if d == "fp32"}
    assert fp32 == {"stage0", "stage1", "stage2", "stage3", "C1", "C2", "C3", "C4", "C5"}
    assert {(c, d) for c, d in runs if d != "fp32"} == {
        ("stage2", "fp16"), ("stage2", "bf16"), ("C4", "fp16"), ("C4", "bf16")}
    assert len(planned) == 13
    for (name, _), pc in runs.items():
        # one grid for all: TP 2 x DP 2, so both DP sharding and P_a are exercised
        assert (pc.parallel.world_size, pc.parallel.tp) == (4, 2)
        if name.startswith("stage"):
            assert pc.zero.stage == int(name[5:]) and pc.zero_r.name == "off"
            assert not pc.zero_r.activation_checkpointing
        else:
            assert pc.zero_r.name == name.lower()
    assert runs[("C2", "fp32")].zero.stage == 1 and runs[("C2", "fp32")].zero_r.partition_activations
    assert runs[("C3", "fp32")].zero.stage == 2 and not runs[("C3", "fp32")].zero_r.partition_activations
    assert runs[("C5", "fp32")].zero_r.cpu_checkpointing
    # fp16 starts at loss scale 2^12 (see the yaml); the other dtypes keep the default
    assert runs[("C4", "fp16")].zero.initial_scale_power == 12
    assert runs[("C4", "bf16")].zero.initial_scale_power == C.ZeroConfig().initial_scale_power
    # the reference run is added even when the user leaves it out
    cfg2 = make_cfg("experiment.params.configs=[C4]", "experiment.params.mixed_configs=[]")
    assert [(p.params["config"], p.params["dtype"]) for p in F.plan(cfg2)] == [
        ("stage0", "fp32"), ("C4", "fp32")]
    with pytest.raises(ValueError, match="unknown configuration"):
        F.plan(make_cfg("experiment.params.configs=[C9]"))


@functools.lru_cache(maxsize=None)
def _config_dict(steps: int) -> dict:
    return schema.summary(make_cfg(f"train.steps={steps}"))


def _record(config: str, dtype: str, losses, grid_steps: int = 3, status: str = "ok") -> Record:
    cfgd = _config_dict(grid_steps)
    return Record(key=f"{config}-{dtype}", experiment=NAME, point=f"{config} {dtype}",
                  params={"config": config, "dtype": dtype}, mode="measured", status=status,
                  metrics={"losses": list(losses), "skipped_steps": 0}, config=cfgd,
                  hardware={"device_name": "x86_64"}, timestamp="2025-01-01T00:00:00Z")


def test_summarize_rows_and_deviation(tmp_path):
    recs = [_record("stage0", "fp32", [5.0, 4.0, 3.0]),
            _record("stage3", "fp32", [5.0, 4.0 + 2e-6, 3.0 - 1e-6]),
            _record("C4", "bf16", [5.01, 4.2, 3.05]),
            _record("C1", "fp32", [1.0], status="failed")]
    df = pd.DataFrame(F.summarize(recs))
    assert set(df["kind"]) == {"measured"} and set(df["figure"]) == {F.FIGURE}
    loss = df[df["y_name"] == F.LOSS]
    assert len(loss) == 9 and sorted(set(loss["x_value"])) == [0, 1, 2]
    assert not df["series"].str.contains("C1").any()  # failed points make no rows
    maxd = df[df["y_name"] == F.MAXD].set_index("config")
    assert list(df["y_name"][:2]) == [F.MAXD, F.MAXD]  # listed first: the CLI prints them
    assert set(maxd.index) == {"stage3", "C4"}  # none for the reference itself
    assert maxd.loc["stage3", "y_value"] == pytest.approx(2e-6, rel=1e-6)
    assert maxd.loc["stage3", "within_tolerance"] and maxd.loc["stage3", "tolerance"] == 1e-5
    assert maxd.loc["C4", "y_value"] == pytest.approx(0.2)
    assert not maxd.loc["C4", "within_tolerance"] and maxd.loc["C4", "tolerance"] == 0.15
    d = df[(df["y_name"] == F.DLOSS) & (df["config"] == "stage3")]
    assert list(d["y_value"]) == pytest.approx([0.0, 2e-6, 1e-6], abs=1e-12)
    # runs on another grid (here: other step count) are compared only with their own reference
    df2 = pd.DataFrame(F.summarize(recs + [_record("stage1", "fp32", [5, 4, 3, 2], 4)]))
    assert df2["series"].str.startswith("[tiny w4=tp2xdp2 pystdlib 4 steps]").any()
    assert (df2["y_name"] == F.MAXD).sum() == 2  # the 4-step run has no stage 0 reference

    # table + plot from these records alone: the paper's Fig. 5 only in its own panel
    out = plot.regenerate(NAME, str(tmp_path), F, records=recs)
    table = pd.read_csv(out["table"])
    assert "paper" not in set(table["kind"])  # never joined with our (incomparable) numbers
    assert [os.path.basename(p) for p in out["figures"]] == [f"{NAME}.png", f"{NAME}.pdf"]
    ctx = CF.paper_context(os.path.join(tmp_path, NAME), F.PAPER_FIG)
    assert set(ctx["kind"]) == {"paper"} and len(ctx) == 12  # 2 curves x 6 digitized points
    assert ctx["y_value"].between(8, 12).all()


@pytest.mark.slow  # two real runs at world 2: ~15-35 s on 2 shared cores
def test_tiny_end_to_end_fp32_losses_coincide(tmp_path):
    """Stage 0 and stage 3 (P_os+g+p) at world 2 = DP 2 through the real worker: the same loss
    at every step (reduction order only), and the loss falls."""
    cfg = make_cfg("experiment.params.world_size=2", "experiment.params.tp=1",
                   "experiment.params.configs=[stage3]", "experiment.params.mixed_configs=[]",
                   "train.steps=6", f"experiment.results_dir={tmp_path}")
    result = orchestrate.run_sweep(cfg, F, progress=False)
    assert result.count("ok") == 2, [r.reason for r in result.records]
    df = pd.DataFrame(F.summarize(result.records))
    worst = df[df["y_name"] == F.MAXD]
    assert len(worst) == 1 and worst["config"].iloc[0] == "stage3"
    assert worst["y_value"].iloc[0] <= 1e-5
    for r in result.records:
        assert r.metrics["loss_decreased"] and math.isfinite(r.metrics["loss_last"])
        assert r.topology["dp"] == 2

"""The GPU proof experiment (experiments/gpu_proof.py) on its CPU path, so it cannot rot: tiny
MFU model at stages 0 and 3, the paper's 40B C4 and 100B C5 points as one rank of 400 (MP 16)
at a tiny depth and width under the fake process group, with the real run's ledger beside the
dry run's prediction, and the bf16 equivalence of stages 0-3 against a torch AdamW reference.
Records land in results/gpu_proof/points.jsonl and the comparisons are computed."""
from __future__ import annotations

import os

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from experiments import gpu_proof as G
from zero_repro import config as C
from zero_repro.lab.cli import conf_dir
from zero_repro.lab.figures import regenerate
from zero_repro.lab import sweep
from zero_repro.lab.records import RecordStore


def _cfg(*overrides: str) -> C.Config:
    C.register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        d = compose("config", overrides=["+exp=gpu_proof", *overrides])
    return C.validate(C.to_config(d))


def test_plan_on_cuda_is_the_paper_points_at_full_depth(monkeypatch):
    monkeypatch.setattr(G.torch.cuda, "is_available", lambda: True)
    pts = {p.name: p for p in G.plan(_cfg())}
    assert set(pts) == {"mfu stage0", "mfu stage3", "paper 40B C4", "paper 100B C5",
                        "equivalence bf16"}
    c4, c5 = pts["paper 40B C4"].overrides, pts["paper 100B C5"].overrides
    assert (c4["model.n_layer"], c4["model.n_embd"], c4["parallel.world_size"],
            c4["parallel.tp"], c4["zero_r.name"]) == (50, 8192, 400, 16, "c4")
    assert (c5["model.n_layer"], c5["train.micro_batch_size"], c5["zero_r.name"]) == (125, 32,
                                                                                       "c5")
    assert c4["cluster.device"] == "cuda" and c4["cluster.device_memory_gb"] == 141
    mfu = pts["mfu stage0"].overrides
    assert (mfu["model.n_layer"], mfu["model.n_embd"], mfu["zero.dtype"]) == (48, 1600, "bf16")
    with pytest.raises(ValueError, match="device=cpu"):
        monkeypatch.setattr(G.torch.cuda, "is_available", lambda: False)
        G.plan(_cfg())


def test_cpu_path_writes_records_and_computes_the_comparisons(tmp_path):
    cfg = _cfg("experiment.params.device=cpu", "experiment.params.mfu.steps=3",
               "experiment.params.equivalence.steps=3", f"experiment.results_dir={tmp_path}")
    res = sweep.run_sweep(cfg, G, progress=False)
    assert res.count("ok") == 5, [(r.point, r.reason) for r in res.records]
    recs = {r.point: r for r in RecordStore.for_experiment(str(tmp_path), "gpu_proof").load()}
    assert len(recs) == 5 and all(r.metrics["device_name"].startswith("cpu") for r in
                                  recs.values())
    for label in ("40B C4", "100B C5"):
        m = recs[f"paper {label}"].metrics
        assert m["world_size"] == 400 and m["tp"] == 16 and m["n_layer"] == 2
        # the real rank's ledger equals the dry run's prediction for the same config
        assert m["model_state_bytes"] == m["predicted_model_state_bytes"] > 0
        assert m["model_states_ratio"] == 1.0
        assert m["predicted_peak_allocated"] >= m["predicted_model_state_bytes"]
        assert m["skipped_steps"] == 0
    eq = recs["equivalence bf16"].metrics
    assert eq["equivalent"], eq["checks"]
    assert set(eq["stages"]) == {"0", "1", "2", "3"}
    assert all(s["max_loss_rel_diff"] < 1e-3 for s in eq["stages"].values())
    assert recs["mfu stage0"].metrics["mfu"] is None  # no peak on the CPU: no MFU target
    rows = pd.DataFrame(G.summarize(list(recs.values())))
    ratio = rows[rows["y_name"] == "step_time_ratio"]["y_value"]
    assert len(ratio) == 1 and ratio.iloc[0] > 0
    assert "mfu_stage0_met" not in set(rows["y_name"])  # targets are for CUDA only
    assert {"model_states_ratio", "predicted_peak_reserved_GB"} <= set(rows["y_name"])
    out = regenerate.regenerate("gpu_proof", str(tmp_path), experiment=G)
    assert os.path.exists(out["table"]) and out["figures"]

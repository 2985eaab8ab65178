"""The GPU proof (experiments/gpu_proof.py): its plan for one GPU and for a node (equivalence
first, a time estimate within the 10-minute budget, the paper points at full depth built on the
device), and its CPU dry path at world 1 and world 4 (every part runs, every check holds, the
NCCL ranks' bucket transport on gloo, records + report written). The CUDA run itself is the
``gpu``-marked test at the end (skipped without CUDA)."""
from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from experiments import gpu_proof as G
from zero_repro import config as C
from zero_repro.lab import sweep
from zero_repro.lab.cli import conf_dir
from zero_repro.lab.figures import regenerate
from zero_repro.lab.records import RecordStore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(*overrides: str) -> C.Config:
    C.register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        d = compose("config", overrides=["+exp=gpu_proof", *overrides])
    return C.validate(C.to_config(d))


@pytest.mark.parametrize("gpus", [1, 8])
def test_plan_for_gpus_equivalence_first_within_the_budget(gpus):
    """The plan of the CUDA run is made on any machine (no GPU needed to plan)."""
    cfg = _cfg("experiment.action=plan", f"experiment.params.gpus={gpus}")
    pts = G.plan(cfg)
    names = [p.name for p in pts]
    assert names[:2] == ["probe", "equivalence fp32"]
    eq = pts[1].params
    assert eq["stages"] == [0, 1, 2, 3] and eq["tol"] == 1e-5
    assert eq["tps"] == ([1] if gpus == 1 else [1, 2])  # a node: DP 8 and TP 2 x DP 4
    if gpus == 1:
        assert names[2:] == ["offload P_a+cpu", "throughput stage0", "throughput stage3",
                             "paper 40B C4", "paper 100B C5", "zero_offload stage 2"]
        by = {p.name: p.overrides for p in pts}
        c4, c5 = by["paper 40B C4"], by["paper 100B C5"]
        # full depth: built on the device (gpu_proof._device_built_gpt), not the CPU's 142B draws
        assert (c4["model.n_layer"], c4["model.n_embd"], c4["parallel.world_size"],
                c4["parallel.tp"], c4["zero_r.name"]) == (50, 8192, 400, 16, "c4")
        assert (c5["model.n_layer"], c5["train.micro_batch_size"], c5["zero_r.name"]) == (
            125, 32, "c5")
        thr = by["throughput stage0"]
        assert (thr["model.n_layer"], thr["model.n_embd"], thr["zero.dtype"],
                thr["zero_r.constant_buffers"], thr["zero.reduce_bucket_size"]) == (
            48, 1600, "bf16", True, 50_000_000)
    else:
        assert names[2:] == ["node stages 0-3"] and pts[2].overrides["parallel.world_size"] == 8
    total = sum(G.estimate_s(cfg, p) for p in pts)
    assert 60 < total <= 600, total
    note = "\n".join(G.plan_note(cfg, pts))
    assert f"time estimate on {gpus} x h200" in note and "of the 10 min budget" in note
    assert "WARNING" not in note


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA present")
def test_run_without_cuda_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="device=cpu"):
        G.plan(_cfg())  # action=run, device=cuda, and this machine shows no CUDA device


@pytest.mark.slow
def test_plan_command_prints_the_estimate(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "+exp=gpu_proof",
                        "experiment.action=plan", f"hydra.run.dir={tmp_path}"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    first = [ln for ln in lines if "todo" in ln][:2]
    assert "probe" in first[0] and "equivalence fp32" in first[1]
    (est,) = [ln for ln in lines if ln.startswith("time estimate on 1 x h200")]
    assert float(est.split(": ")[1].split(" min")[0]) <= 10.0


def test_overlap_stats():
    k = [("ampere_gemm", 0.0, 1.0), ("ncclKernel_AllGather", 0.5, 1.5),
         ("elementwise", 2.0, 2.2), ("ncclDevKernel_ReduceScatter", 3.0, 3.5)]
    o = G.overlap_stats(k)
    assert o["nccl_s"] == pytest.approx(1.5)
    assert o["nccl_overlapped_share"] == pytest.approx(0.5 / 1.5)
    assert o["nccl_exposed_s"] == pytest.approx(1.0)
    assert G.overlap_stats([("gemm", 0, 1)])["nccl_overlapped_share"] is None


def test_node_targets():
    st = {"0": {"step_over_stage0": 1.0, "nccl_overlapped_share": 0.7},
          "1": {"step_over_stage0": 1.04, "nccl_overlapped_share": 0.5},
          "2": {"step_over_stage0": 1.2, "nccl_overlapped_share": 0.9},
          "3": {"step_over_stage0": 1.2, "nccl_overlapped_share": 0.1}}
    assert G.node_targets(st) == {"stage0_overlap>=0.6": True, "stage1_step<=1.05x": True,
                                  "stage1_overlap>=0.6": False, "stage2_step<=1.05x": False,
                                  "stage2_overlap>=0.6": True, "stage3_step<=1.25x": True}


def _records(path: str) -> dict:
    return {r.point: r for r in RecordStore.for_experiment(path, "gpu_proof").load()}


@pytest.mark.slow
def test_cpu_path_one_gpu_parts(tmp_path):
    cfg = _cfg("experiment.params.device=cpu", "experiment.params.offload.steps=2",
               f"experiment.results_dir={tmp_path}")
    res = sweep.run_sweep(cfg, G, progress=False)
    assert res.count("ok") == 8, [(r.point, r.reason) for r in res.records]
    recs = _records(str(tmp_path))
    for r in recs.values():
        m = r.metrics
        assert m["device_name"].startswith("cpu") and m["nccl_exercised"] is False
        assert m.get("passed", True), (r.point, m.get("checks"))
    eq = recs["equivalence fp32"].metrics
    assert set(eq["configs"]) == {f"tp1 dp1 stage{k}" for k in range(4)}
    assert all(c["transport"] == "native" and c["max_abs_diff"] <= 1e-5
               for c in eq["configs"].values())
    off = recs["offload P_a+cpu"].metrics
    assert off["ckpt_cpu_bytes"] > 0 and off["max_abs_param_diff"] <= 1e-4
    for label in ("40B C4", "100B C5"):
        m = recs[f"paper {label}"].metrics
        assert (m["world_size"], m["tp"], m["n_layer"], m["transport"]) == (400, 16, 2, "native")
        # the real rank's ledger equals the dry run's prediction, NCCL's buffers in both
        assert m["model_state_bytes"] == m["predicted_model_state_bytes"] > 0
        assert m["comm_buffers"] == m["predicted_comm_buffers"] > 0
        assert m["skipped_steps"] == 0
    assert "mfu" not in recs["throughput stage0"].metrics  # no peak on the CPU
    rows = pd.DataFrame(G.summarize(list(recs.values())))
    assert len(rows[rows["y_name"] == "step_time_ratio"]) == 1
    assert not any(str(y).startswith("mfu_stage0") for y in rows["y_name"])  # CUDA targets
    out = regenerate.regenerate("gpu_proof", str(tmp_path), experiment=G)
    report = [p for p in out["figures"] if p.endswith("report.md")]
    assert report and "| equivalence |" in open(report[0]).read()


@pytest.mark.slow  # a lighter sibling of this test stays in the default suite
def test_cpu_path_node_parts_world_4(tmp_path):
    """The node proof's code at world 4 on gloo: DP 4 and TP 2 x DP 2 equivalence with the NCCL
    ranks' transport, the collectives of the probe, stages 0-3 with falling model states."""
    cfg = _cfg("experiment.params.device=cpu", "experiment.params.gpus=8",
               "experiment.params.equivalence.steps=2", f"experiment.results_dir={tmp_path}")
    res = sweep.run_sweep(cfg, G, progress=False)
    assert res.count("ok") == 3, [(r.point, r.reason) for r in res.records]
    recs = _records(str(tmp_path))
    probe = recs["probe"].metrics
    assert probe["world"] == 4 and probe["passed"], probe["checks"]
    assert {"all_reduce", "reduce_scatter", "all_gather"} <= set(probe["checks"])
    eq = recs["equivalence fp32"].metrics
    assert set(eq["configs"]) == {f"tp{t} dp{d} stage{k}" for t, d in ((1, 4), (2, 2))
                                  for k in range(4)}
    assert eq["passed"], eq["checks"]
    node = recs["node stages 0-3"].metrics
    assert node["passed"], node["checks"]
    assert node["checks"] == {"model_state_bytes_falls_with_stage": True}
    assert all(s["transport"] == "native" for s in node["stages"].values())


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_proof_on_one_gpu(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "+exp=gpu_proof",
                        f"experiment.results_dir={tmp_path}", f"hydra.run.dir={tmp_path}/h"],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = _records(str(tmp_path))
    assert all(r.metrics.get("passed", True) for r in recs.values()), \
        {k: r.metrics.get("checks") for k, r in recs.items()}

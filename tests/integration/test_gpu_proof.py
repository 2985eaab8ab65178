"""The GPU proof (experiments/gpu_proof/): its plan for one GPU and for a node (equivalence
first, a time estimate within the 10-minute budget, the paper points at full depth built on the
device), the plan through the command line's pre-flight on a machine with CUDA mocked as one
H100 and as eight (the GPU model read from the device), and its CPU dry path at world 1 and
world 4 (every part runs, every check holds, the NCCL ranks' bucket transport on gloo, records +
report written). The CUDA run itself is the ``gpu``-marked test at the end (skipped without
CUDA)."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from experiments import gpu_proof as G
from experiments.gpu_proof import parts as gpu
from experiments.gpu_proof import time_estimate as GT
from tests import REPO
from zero_repro import config as C
from zero_repro import schema
from zero_repro import validation
from zero_repro.lab import cli, sweep
from zero_repro.lab.cli import conf_dir
from zero_repro.lab.figures import regenerate
from zero_repro.lab.records import RecordStore

H100 = ("NVIDIA H100 80GB HBM3", 81559 * 2**20)  # torch.cuda's name and total memory (SXM5)
# CUDA as seen by the host-side code, for a subprocess: N devices named NAME of MEM bytes
MOCK_CUDA = """
import sys, types, torch
n, name, mem = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
props = types.SimpleNamespace(name=name, total_memory=mem)
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: n
torch.cuda.get_device_name = lambda d=None: name
torch.cuda.get_device_properties = lambda d=None: props
sys.argv = ["run.py"] + sys.argv[4:]
from zero_repro.lab import cli
cli.main()
"""


def _mock_cuda(monkeypatch, n: int, name: str = H100[0], mem: int = H100[1]) -> None:
    props = types.SimpleNamespace(name=name, total_memory=mem)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _cfg(*overrides: str) -> C.Config:
    schema.register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        d = compose("config", overrides=["+exp=gpu_proof", *overrides])
    return validation.validate(schema.to_config(d))


@pytest.mark.parametrize("gpus", [1, 8])
def test_plan_for_gpus_equivalence_first_within_the_budget(gpus, no_cuda):
    """The plan of the CUDA run is made on any machine (no GPU needed to plan: the GPU named)."""
    cfg = _cfg("experiment.action=plan", f"experiment.params.gpus={gpus}",
               "experiment.params.cluster=h200")
    pts = G.plan(cfg)
    names = [p.name for p in pts]
    assert names[:2] == ["probe", "equivalence fp32"]
    eq = pts[1].params
    assert eq["stages"] == [0, 1, 2, 3] and eq["tol"] == 1e-5
    assert eq["tps"] == ([1] if gpus == 1 else [1, 2])  # a node: DP 8 and TP 2 x DP 4
    if gpus == 1:
        assert names[2:] == ["offload P_a+cpu", "throughput stage0", "throughput stage3",
                             "paper 40B C4", "paper 100B C5", "zero_offload stage 2",
                             "zero_offload_param stage 3"]
        by = {p.name: p.overrides for p in pts}
        c4, c5 = by["paper 40B C4"], by["paper 100B C5"]
        # full depth: built unit by unit on the device (partitioned construction), not the CPU's 142B draws
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
    total = sum(GT.estimate_s(cfg, p) for p in pts)
    assert 60 < total <= 600, total
    note = "\n".join(G.plan_note(cfg, pts))
    assert f"time estimate on {gpus} x h200" in note and "of the 10 min budget" in note
    assert "WARNING" not in note


def test_run_without_cuda_is_refused_before_anything_runs(no_cuda):
    with pytest.raises(ValueError, match="device=cpu"):
        G.plan(_cfg())  # action=run, device=cuda, and this machine shows no CUDA device
    with pytest.raises(ValueError, match="experiment.params.cluster=h100"):
        G.plan(_cfg("experiment.action=plan"))  # auto: no GPU to read the model from


@pytest.mark.parametrize("gpus", [1, 8])
def test_plan_passes_the_cli_preflight_on_a_mocked_h100_machine(gpus, monkeypatch, tmp_path):
    """``python run.py +exp=gpu_proof`` on one H100 (and on eight): the command line's
    pre-flight (every point that starts ranks here, GPU count and memory included) accepts the
    plan -- the paper points play rank 0 of 400 in one process -- and every point is an h100
    one: the cluster is read from the device, not fixed."""
    _mock_cuda(monkeypatch, gpus)
    schema.register_configs()
    ((cfg, _, plan),) = cli.check_args(
        ["+exp=gpu_proof", f"experiment.params.gpus={gpus}",
         f"experiment.results_dir={tmp_path}/r", f"hydra.run.dir={tmp_path}/h"])
    assert plan.checked and len(plan.todo) == (9 if gpus == 1 else 3)
    for pp in plan.points:
        c = pp.cfg.cluster
        assert (c.name, c.device, c.device_memory_mib, c.peak_tflops) == ("h100", "cuda",
                                                                            81559, 989)
    if gpus == 1:
        paper = [pp for pp in plan.points if pp.point.params["part"] == "paper"]
        assert [pp.cfg.parallel.world_size for pp in paper] == [400, 400]
        assert all(pp.cfg.launcher.oversubscribe for pp in paper)


PLAN_GPUS = (1, 8)


@pytest.fixture(scope="module")
def mocked_plan_commands(tmp_path_factory) -> dict:
    """``experiment.action=plan`` with CUDA mocked as ``gpus`` H100s in a subprocess, for each
    of ``PLAN_GPUS``: both started at once (two cores; each is mostly interpreter, torch and
    Hydra start-up), each in its own directories. By gpus: (exit status, stdout, stderr)."""
    procs = {}
    for gpus in PLAN_GPUS:
        tmp = tmp_path_factory.mktemp(f"plan{gpus}")
        procs[gpus] = subprocess.Popen(
            [sys.executable, "-c", MOCK_CUDA, str(gpus), *map(str, H100), "+exp=gpu_proof",
             "experiment.action=plan", f"experiment.params.gpus={gpus}",
             f"hydra.run.dir={tmp}", f"experiment.results_dir={tmp}/r"], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    try:
        for gpus, p in procs.items():
            out, err = p.communicate(timeout=120)
            results[gpus] = (p.returncode, out, err)
        return results
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("gpus,minutes", [(1, 5.9), (8, 2.5)])
def test_plan_command_on_a_mocked_h100_machine_prints_the_estimate(gpus, minutes,
                                                                   mocked_plan_commands):
    """The plan as printed (``experiment.action=plan``) with CUDA mocked in the subprocess."""
    returncode, stdout, stderr = mocked_plan_commands[gpus]
    assert returncode == 0, stderr[-2000:]
    (est,) = [ln for ln in stdout.splitlines() if ln.startswith("time estimate on")]
    assert est.startswith(f"time estimate on {gpus} x h100 GPU(s): {minutes} min of the 10 min")


@pytest.mark.parametrize("name,gib,cluster", [
    ("NVIDIA H100 80GB HBM3", 79.2, "h100"), ("NVIDIA H200", 140.4, "h200"),
    ("NVIDIA A100-SXM4-80GB", 79.3, "dgx_a100_80g"), ("NVIDIA A100-SXM4-40GB", 39.4,
                                                     "dgx_a100_40g"),
    ("Tesla V100-SXM3-32GB", 31.7, "dgx2_v100"), ("NVIDIA L40S", 44.4, "l40s_pcie"),
    ("NVIDIA H100 PCIe", 79.2, None), ("NVIDIA H100 NVL", 93.1, None),
    ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 39.2, None), ("NVIDIA GeForce RTX 4090", 23.6, None)])
def test_gpu_cluster_from_name_and_memory(name, gib, cluster):
    assert G.gpu_cluster(name, int(gib * 2**30)) == cluster


def test_named_cluster_must_be_this_gpu(monkeypatch):
    _mock_cuda(monkeypatch, 1)
    with pytest.raises(ValueError, match="experiment.params.cluster=h100 \\(or auto\\)"):
        G.plan(_cfg("experiment.params.cluster=h200"))
    with pytest.raises(ValueError, match="is not a GPU cluster"):
        G.plan(_cfg("experiment.params.cluster=local"))
    _mock_cuda(monkeypatch, 1, "NVIDIA H100 PCIe")
    with pytest.raises(ValueError, match="matches no GPU of conf/cluster"):
        G.plan(_cfg())


@pytest.mark.slow
def test_plan_command_prints_the_estimate(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "+exp=gpu_proof",
                        "experiment.action=plan", "experiment.params.cluster=h200",
                        f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    first = [ln for ln in lines if "todo" in ln][:2]
    assert "probe" in first[0] and "equivalence fp32" in first[1]
    (est,) = [ln for ln in lines if ln.startswith("time estimate on 1 x h200")]
    assert float(est.split(": ")[1].split(" min")[0]) <= 10.0


def test_overlap_stats():
    k = [("ampere_gemm", 0.0, 1.0), ("ncclKernel_AllGather", 0.5, 1.5),
         ("elementwise", 2.0, 2.2), ("ncclDevKernel_ReduceScatter", 3.0, 3.5)]
    o = gpu.overlap_stats(k)
    assert o["nccl_s"] == pytest.approx(1.5)
    assert o["nccl_overlapped_share"] == pytest.approx(0.5 / 1.5)
    assert o["nccl_exposed_s"] == pytest.approx(1.0)
    assert gpu.overlap_stats([("gemm", 0, 1)])["nccl_overlapped_share"] is None


def test_node_targets():
    st = {"0": {"step_over_stage0": 1.0, "nccl_overlapped_share": 0.7},
          "1": {"step_over_stage0": 1.04, "nccl_overlapped_share": 0.5},
          "2": {"step_over_stage0": 1.2, "nccl_overlapped_share": 0.9},
          "3": {"step_over_stage0": 1.2, "nccl_overlapped_share": 0.1}}
    assert gpu.node_targets(st) == {"stage0_overlap>=0.6": True, "stage1_step<=1.05x": True,
                                  "stage1_overlap>=0.6": False, "stage2_step<=1.05x": False,
                                  "stage2_overlap>=0.6": True, "stage3_step<=1.25x": True}


LEDGER = {"params_lp": 4e9, "grads": 4e9, "master_fp32": 0, "adam_m": 8e9, "adam_v": 8e9,
          "comm_buffers": 0.4e9, "ckpt_device": 1.0e9, "arena_capacity": 1.2e9}
STATS = {"requested_bytes.all.peak": 40e9, "allocated_bytes.all.peak": 40.5e9,
         "reserved_bytes.all.peak": 44e9}


def test_memory_by_category_adds_up_and_names_the_miss(monkeypatch):
    """held (ledger) + working + rounding = peak allocated, + cached = peak reserved, on both
    sides; a ratio inside the band says nothing, outside it names the category that differs
    most and its known reasons."""
    from zero_repro.lab import cuda_memory as M
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: {**STATS, "num_ooms": 0})
    stats = M.memory_stats(torch.device("cuda", 0))
    assert stats["allocated_bytes.all.peak"] == 40.5e9 and stats["num_alloc_retries"] == 0
    real = M.measured(LEDGER, stats, cpu_checkpoints=False)
    assert real["model_states"] == 24e9 and real["checkpoints"] == 1.2e9  # the device arena
    assert real["working"] == 40e9 - (24e9 + 0.4e9 + 1.2e9)
    assert sum(real[c] for c in M.ALLOCATED) == 40.5e9
    assert sum(real.values()) == 44e9
    assert M.measured(LEDGER, None, cpu_checkpoints=True)["checkpoints"] == 0  # on the host
    pred = M.predicted(LEDGER, {"peak_requested": 36e9, "peak_allocated": 36.4e9,
                                "peak_reserved": 37e9}, cpu_checkpoints=False)
    assert M.miss(real, pred, 40.5 / 36.4, (0.95, 1.15)) == ""
    why = M.miss(real, pred, 40.5 / 36.4, (0.95, 1.10))
    assert why.startswith("peak allocated 1.113x") and "working differs most (+4.00 GB" in why
    assert "flash attention" in why and "cuBLAS" in why
    assert M.table(real, pred)[2] == "| model_states | 24.000 | 24.000 | +0.000 |"


def test_report_and_result_lines_show_the_paper_memory_by_category():
    from types import SimpleNamespace
    from zero_repro.lab import cuda_memory as M
    real = M.measured(LEDGER, STATS, cpu_checkpoints=False)
    pred = M.predicted(LEDGER, {"peak_requested": 36e9, "peak_allocated": 36.4e9,
                                "peak_reserved": 37e9}, cpu_checkpoints=False)
    metrics = {"part": "paper", "point": "40B C4", "device": "cuda", "device_name": "H100",
               "wall_s": 60.0, "passed": False, "allocated_ratio": 40.5 / 36.4,
               "ratio_range": [0.95, 1.10], "memory_by_category": {"measured": real,
                                                                   "dry_run": pred}}
    rec = SimpleNamespace(status="ok", point="paper 40B C4", timestamp=1.0, mode="measured",
                          metrics=metrics)
    table = pd.DataFrame(G.summarize([rec]))
    text = G.report_text(table)
    assert "### paper 40B C4: peak device memory by category" in text
    assert "| working | 14.400 | 10.400 | +4.000 |" in text
    assert "Peak allocated 1.113x the dry run's, outside [0.95, 1.1]: working differs" in text
    lines = G.conclude(table)
    assert lines[0] == "paper 40B C4: FAILED"
    assert lines[-1].startswith("paper 40B C4: peak allocated 1.113x the dry run's -- peak "
                                "allocated 1.113x") and "working differs most" in lines[-1]


def _records(path: str) -> dict:
    return {r.point: r for r in RecordStore.for_experiment(path, "gpu_proof").load()}


@pytest.mark.slow
def test_cpu_path_one_gpu_parts(tmp_path):
    cfg = _cfg("experiment.params.device=cpu", "experiment.params.offload.steps=2",
               f"experiment.results_dir={tmp_path}")
    res = sweep.run_sweep(cfg, G, progress=False)
    assert res.count("ok") == 9, [(r.point, r.reason) for r in res.records]
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
        real, pred = m["memory_by_category"]["measured"], m["memory_by_category"]["dry_run"]
        assert real["model_states"] == pred["model_states"] and real["working"] is None
    assert "mfu" not in recs["throughput stage0"].metrics  # no peak on the CPU
    rows = pd.DataFrame(G.summarize(list(recs.values())))
    assert len(rows[rows["y_name"] == "step_time_ratio"]) == 1
    assert not any(str(y).startswith("mfu_stage0") for y in rows["y_name"])  # CUDA targets
    out = regenerate.regenerate("gpu_proof", str(tmp_path), experiment=G)
    report = [p for p in out["figures"] if p.endswith("report.md")]
    text = open(report[0]).read()
    assert "| equivalence |" in text and "### paper 100B C5: peak device memory by category" in text


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

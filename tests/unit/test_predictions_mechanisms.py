"""The estimate's mechanisms beyond the kernel model, each a switch: NCCL's per-call cost model
(scale/collectives.py: latency per ring step, protocol switch, bus bandwidth against the message
size), the compute slowed by the collectives it hides (scale/overlap.py), the verdict at the
limit (scale/limit.py), the 2020 stack (scale/era.py: the estimate's first line, the 2019
Megatron layer's activations in the dry run, paper2020 timing offload)."""
from __future__ import annotations

import dataclasses

import pytest

from zero_repro import config as C
from zero_repro import schema, validation
from zero_repro.lab import estimate as L
from zero_repro.scale import collectives as CL
from zero_repro.scale import era
from zero_repro.scale import estimate as E
from zero_repro.scale import estimate_time as T
from zero_repro.scale import kernels as K
from zero_repro.scale import limit
from zero_repro.scale import modern_step as M
from zero_repro.scale import overlap as OV
from zero_repro.scale import perf_model as P
from zero_repro.scale.hardware import hardware
from zero_repro.scale.paper.clusters import load_cluster

from tests.unit.test_estimate import base

GB = 1e9


# ------------------------------------------------------------------------------ collectives
def test_bus_bandwidth_rises_with_the_message_and_protocols_switch():
    bw = 300e9
    sizes = [2.0 ** k for k in range(10, 31, 2)]
    curve = [CL.bus_bandwidth("all_gather", s, 8, bw) for s in sizes]
    assert all(a < b for a, b in zip(curve, curve[1:]))
    assert curve[0] < 0.01 * bw and 0.95 * bw < curve[-1] <= bw
    assert CL.protocol("all_gather", 4096, 8, bw) == "LL"
    assert CL.protocol("all_gather", 1 << 30, 8, bw) == "Simple"
    assert CL.protocol("all_gather", 4 << 20, 8, bw) == "LL128"
    # LL128 only over NVLink, and not in the paper's NCCL 2.4
    assert "LL128" not in CL.protocols("pcie") and "LL128" not in CL.protocols("nvlink", "2020")


def test_small_all_reduce_latency_matches_a_published_curve():
    # NVIDIA/nccl#583: 2 x A100-SXM4-40GB, all_reduce_perf, 32 B in 10.1 us
    t = CL.time("all_reduce", 32, 2, 200e9)
    assert 5e-6 < t < 15e-6


def test_ring_steps_and_network_hops_grow_the_latency():
    one = CL.time("all_gather", 1 << 20, 8, 300e9)
    many = CL.time("all_gather", 1 << 20, 64, 300e9, nodes=8)
    assert many > 3 * one
    assert CL.steps("all_reduce", 16, 2) == (30, 4) and CL.steps("all_gather", 16, 2) == (15, 1)
    assert CL.share("all_gather", "LL128", 8, ppn=1) < CL.share("all_gather", "LL128", 8)
    with pytest.raises(ValueError, match="collective"):
        CL.steps("broadcast", 2, 1)


def _w(dp: int, stage: int = 3, **kw) -> P.Workload:
    return P.Workload(n_layer=32, hidden=4096, heads=32, gpus=dp, tp=1, batch_per_gpu=1,
                      seq=4096, vocab=32000, stage=stage, ffn=11008, kv_heads=32,
                      overlap_comm=True, bucket_elems=5e8, **kw)


def test_stage3_gathers_shrink_per_rank_and_cost_more_at_scale():
    hw, dk = hardware("h100"), K.device_kernels("h100_sxm")
    nccl, ring = M.Modern(), M.Modern(collectives="ring")
    w8, w1k = _w(8), _w(1024)
    t8 = M.dp_terms(w8, hw, dk, (1.0, 2.0), "mid", nccl)["dp_total"]
    t1k = M.dp_terms(w1k, hw, dk, (1.0, 2.0), "mid", nccl)["dp_total"]
    assert t1k > t8  # (n-1)/n barely moves; the ring's latency grows with N_d
    r1k = M.dp_terms(w1k, hw, dk, (1.0, 2.0), "mid", ring)["dp_total"]
    assert t1k != r1k  # the switch changes the model


# ------------------------------------------------------------------------------ overlap
def test_overlap_slowdown_is_the_band_times_the_hidden_seconds():
    hw, dk = hardware("h100"), K.device_kernels("h100_sxm")
    b = OV.band("h100_sxm")
    assert b["low"] == pytest.approx(16 / 132) and b["low"] < b["mid"] < b["high"]
    assert OV.band("v100")["low"] == pytest.approx(12 / 80)
    windows = (10.0, 20.0)  # compute hides everything but the first unit
    for stage in (0, 2, 3):
        r = M.dp_terms(_w(64, stage), hw, dk, windows, "mid")
        hidden = r["dp_total"] - r["dp_exposed"]
        assert hidden > 0 and r["overlap_slowdown"] == pytest.approx(b["mid"] * hidden)
    assert M.dp_terms(_w(64, 1), hw, dk, windows, "mid")["overlap_slowdown"] == 0.0
    off = M.Modern(overlap_slowdown=False)
    assert M.dp_terms(_w(64, 3), hw, dk, windows, "mid", off)["overlap_slowdown"] == 0.0


def test_overlap_slowdown_is_a_term_of_the_step():
    hw, dk = hardware("h100"), K.device_kernels("h100_sxm")
    on = M.step_terms(_w(64, 3), hw, dk, M.Modern())
    off = M.step_terms(_w(64, 3), hw, dk, M.Modern(overlap_slowdown=False))
    assert on["overlap_slowdown"] > 0
    assert on["total"] - off["total"] == pytest.approx(on["overlap_slowdown"])


# ------------------------------------------------------------------------------ at the limit
def test_verdict_at_the_limit_has_a_band():
    fits = limit.judge(60 * GB, 62 * GB, 80 * GB, 0.3 * GB, 1.7 * GB, True)
    assert fits["verdict"] == "fits" and fits["need_high"] == pytest.approx(65.7 * GB)
    near = limit.judge(76 * GB, 78 * GB, 80 * GB, 0.3 * GB, 1.7 * GB, True)
    assert near["verdict"] == "at the limit" and limit.label(near) == "limit+"
    near_oom = limit.judge(78 * GB, 81 * GB, 80 * GB, 0.3 * GB, 1.7 * GB, False)
    assert limit.label(near_oom) == "limit-"
    assert limit.judge(81 * GB, 82 * GB, 80 * GB, 0.3 * GB, 1.7 * GB, False)["verdict"] == "OOM"
    assert limit.judge(1, 2, 80 * GB, 0, 0, False, build_fits=False)["verdict"] == "OOM"


def test_estimate_judges_each_stage_with_a_band(capsys):
    est = E.estimate(base(), (2, 3), "ckpt", search=False, workers=1,
                     timing=T.Timing(gpu="h100_sxm"))
    for s in est.stages:
        assert s.limit["need_low"] <= s.peak_reserved + est.outside["mid"] <= s.limit["need_high"]
    text = L.report(est)
    assert text.splitlines()[0].startswith("Stack assumed: modern")
    assert "band: need on the device (GB)" in text


# ------------------------------------------------------------------------------ 2020 stack
def _gpt(stage: int, world: int = 2) -> C.Config:
    return E.stage_config(base("tiny", world), stage, "ckpt", 2)


def test_2020_stack_runs_the_2019_megatron_layer_in_the_dry_run():
    assert era.with_stack(_gpt(2), "2020").simulate.only_switches == list(era.MEGATRON_2019)
    assert not era.with_stack(_gpt(3), "2020").simulate.only_switches  # no 2020 stage 3
    assert not era.with_stack(_gpt(2), "modern").simulate.only_switches
    llama = E.stage_config(base(), 2, "ckpt", 2)
    assert not era.with_stack(llama, "2020").simulate.only_switches
    old = E.estimate(base("tiny", 2), (2,), "ckpt", search=False, workers=1,
                     timing=T.Timing(model="paper2020"))
    new = E.estimate(base("tiny", 2), (2,), "ckpt", search=False, workers=1,
                     timing=T.Timing(model="paper2020", gpu="v100"))
    assert old.stack == "2020"
    mod = E.estimate(base("tiny", 2), (2,), "ckpt", search=False, workers=1,
                     timing=T.Timing(gpu="h100_sxm"))
    # dropout masks, materialized scores, GELU intermediates and fp32 logits: more activations
    assert old.stages[0].parts["activations"] > mod.stages[0].parts["activations"]
    assert new.stages[0].parts == old.stages[0].parts
    assert L.report(old).splitlines()[0].startswith("Stack assumed: 2020")


def test_paper2020_times_offload_with_host_work():
    cfg = validation.validate(C.Config(model=C.ModelConfig(**schema.model_conf("gpt_8b")),
                                       parallel=C.ParallelConfig(world_size=64, tp=1),
                                       cluster=load_cluster("dgx2_v100")))
    on = E.stage_config(cfg, 2, "ckpt", 8, offload="cpu")
    off = E.stage_config(cfg, 2, "ckpt", 8)
    tm = T.Timing(model="paper2020")
    p_on = T.performance(on, T.hardware_for(on), None, tm)
    p_off = T.performance(off, T.hardware_for(off), None, tm)
    assert p_on["model"] == "paper2020" and p_on["host_s"] > 0 and p_off["host_s"] == 0
    assert p_on["step_s"] > p_off["step_s"]
    assert p_off["overlap_slowdown_s"] == 0.0  # the 2020 stack hides no DP collective
    # an overlapping workload on the V100: the hidden seconds times the Volta band
    w = dataclasses.replace(T.workload(off), overlap_comm=True)
    hw = T.hardware_for(off)
    over = T._paper2020(off, w, hw, None, "v100", tm)
    serial = T._paper2020(off, dataclasses.replace(w, overlap_comm=False), hw, None, "v100", tm)
    hidden = serial["dp_s"] - over["dp_s"]
    assert hidden > 0
    assert over["overlap_slowdown_s"] == pytest.approx(OV.band("v100")["mid"] * hidden)


def test_breakdown_parts_add_up_and_bands_hold_the_middle():
    from zero_repro.lab import estimate_breakdown as B
    for cfg, tm in ((B.config("llama2_7b", "h100", 64, 1, 3, 1), T.Timing()),
                    (B.config("gpt_8b", "dgx2_v100", 400, 8, 2, 4, dtype="fp16"),
                     T.Timing(model="paper2020"))):
        r = B.row("x", cfg, tm)
        assert sum(r[k] for k in B.PARTS) == pytest.approx(r["step_s"], rel=1e-9)
        assert r["band_fast_s"] < r["step_s"] < r["band_slow_s"]


def test_2020_stack_with_offload_runs_the_2019_layer_beside_the_host_optimizer():
    est = E.estimate(base("tiny", 2), (2,), "ckpt", search=False, workers=1,
                     timing=T.Timing(model="paper2020"), offload="cpu")
    mod = E.estimate(base("tiny", 2), (2,), "ckpt", search=False, workers=1,
                     timing=T.Timing(gpu="h100_sxm"), offload="cpu")
    s = est.stages[0]
    assert s.host_bytes > 0 and s.perf["model"] == "paper2020"
    assert s.parts["activations"] > mod.stages[0].parts["activations"]
    # a switch of DeepSpeed 0.2 itself still has no offload
    cfg = E.stage_config(base("tiny", 2), 2, "ckpt", 2, offload="cpu")
    with pytest.raises(ValueError, match="2020 stack"):
        validation.validate(dataclasses.replace(cfg, simulate=C.SimulateConfig(
            only_switches=["stage2_single_ipg_bucket"])))

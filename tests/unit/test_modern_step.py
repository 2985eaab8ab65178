"""The modern stack's step (scale/modern_step.py): the terms add up, the causal, flash / unfused
and activation-checkpointing switches move the time as the formulas say, the band brackets the
middle, MFU / HFU follow their conventions, and the DP overlap rule holds at its limits."""
from __future__ import annotations

import dataclasses

import pytest

from zero_repro import config as C
from zero_repro import gpus
from zero_repro.runtime.model import flops
from zero_repro.scale import kernel_sources as S
from zero_repro.scale import kernels as K
from zero_repro.scale import modern_step as M
from zero_repro.scale import perf_model as P
from zero_repro.scale.hardware import Hardware, hardware, list_clusters, load_cluster

# Llama 3 8B's shape, one 8192-token sequence per GPU, ZeRO-3 over 8 GPUs
W = P.Workload(n_layer=32, hidden=4096, heads=32, gpus=8, tp=1, batch_per_gpu=1, seq=8192,
               vocab=128256, stage=3, ffn=14336, kv_heads=8, overlap_comm=True,
               bucket_elems=5e8)


def _hardware(device: str) -> Hardware:
    """The cluster that names GPU ``device``; a GPU no cluster names sits in DGX H100 nodes."""
    named = [c for c in list_clusters() if load_cluster(c).gpu == device]
    if named:
        return hardware(named[0])
    bare = {f: 0 for f in C.GPU_FIELDS}  # refilled from the GPU named
    return Hardware.from_config(dataclasses.replace(load_cluster("h100"), gpu=device, **bare))


def _run(device="h100_sxm", w=W, **kw):
    return M.step_terms(w, _hardware(device), K.device_kernels(device), M.Modern(**kw))


@pytest.mark.parametrize("device", sorted(gpus.known()))
def test_terms_add_up_and_band_brackets_the_middle(device):
    hw, dk = _hardware(device), K.device_kernels(device)
    w = dataclasses.replace(W, gpus=hw.gpus_per_node)
    r = M.step(w, hw, dk, M.Modern())
    assert sum(r["terms"].values()) == pytest.approx(r["step_s"])
    fast, slow = r["step_s_band"]
    assert fast <= r["step_s"] <= slow
    assert r["band"]["low"]["tokens_per_s"] <= r["tokens_per_s"] <= r["band"]["high"][
        "tokens_per_s"]
    assert r["band"]["low"]["mfu"] <= r["mfu"] <= r["band"]["high"]["mfu"] < 1
    assert [k for k, _, _ in r["largest"]] == sorted(r["terms"], key=lambda k: -r["terms"][k])[:3]


def test_causal_halves_the_attention_flops():
    # A100: one efficiency for causal and not -> exactly half, less the kernel starts
    l, t0 = W.n_layer, S.KERNEL_START_S
    for ps in ("attention_fwd", "attention_bwd"):
        full = _run("a100_80gb", causal=False)[ps] - l * t0
        half = _run("a100_80gb", causal=True)[ps] - l * t0
        assert half == pytest.approx(full / 2)
    # H100: the causal kernels' own efficiency (FA1791) -> half the FLOPs at e_causal
    dk = K.device_kernels("h100_sxm")
    ratio = dk.attn[("fwd", False)].mid / dk.attn[("fwd", True)].mid
    full = _run(causal=False)["attention_fwd"] - l * t0
    half = _run(causal=True)["attention_fwd"] - l * t0
    assert half == pytest.approx(full / 2 * ratio)


def test_unfused_attention_is_the_batched_gemms_plus_the_score_traffic():
    hw, dk = hardware("h100"), K.device_kernels("h100_sxm")
    b, s, d, heads = 1.0, 8192.0, 128.0, 32.0
    one = K.gemm_seconds(dk, hw.peak_flops, hw.hbm_bw, s, s, d, b * heads)
    scores = b * heads * s * s
    got = M.attention_time(W, hw, dk, M.Modern(attention="unfused"), "mid")
    assert got["fwd"] == pytest.approx(2 * one + scores * 20 / (hw.hbm_bw * dk.hbm.mid))
    assert got["bwd"] == pytest.approx(4 * one + scores * 22 / (hw.hbm_bw * dk.hbm.mid))
    assert M.SCORE_BYTES == (20, 22)
    flash = M.attention_time(W, hw, dk, M.Modern(), "mid")
    assert got["fwd"] > flash["fwd"] and got["bwd"] > flash["bwd"]
    # causal does not shorten the unfused path: the masked products are computed
    assert M.attention_time(W, hw, dk, M.Modern(attention="unfused", causal=False),
                            "mid") == got


def test_activation_checkpointing_recomputes_the_blocks_forward():
    none, sel, full = (_run(ac=a) for a in ("none", "selective", "full"))
    assert none["recompute"] == 0
    hw, dk = hardware("h100"), K.device_kernels("h100_sxm")
    block, _ = M.gemm_shapes(W)
    fwd = sum(K.gemm_seconds(dk, hw.peak_flops, hw.hbm_bw, m, n, k)
              for m, n, k, ps in block if ps == "fwd")
    attn = M.attention_time(W, hw, dk, M.Modern(), "mid")["fwd"]
    mem = K.memory_seconds(dk, hw.hbm_bw, M.layer_bytes(W, "eager")[0])
    assert full["recompute"] == pytest.approx(W.n_layer * (fwd + attn + mem))
    assert sel["recompute"] == pytest.approx(full["recompute"] / 2)  # every 2nd block
    assert _run(ac="selective", every=4)["recompute"] == pytest.approx(full["recompute"] / 4)
    assert none["total"] < sel["total"] < full["total"]
    for k in ("gemm_fwd", "gemm_bwd", "attention_fwd", "optimizer"):
        assert none[k] == full[k]


def test_mfu_and_hfu_conventions():
    hw, dk = hardware("h100"), K.device_kernels("h100_sxm")
    model = flops.flops_per_iteration_shape(1, 8192, 32, 4096, 128256, False, kv_width=1024,
                                            ffn=14336, gated=True)
    with_rc = flops.flops_per_iteration_shape(1, 8192, 32, 4096, 128256, True, kv_width=1024,
                                              ffn=14336, gated=True)
    none = M.step(W, hw, dk, M.Modern(ac="none"))
    full = M.step(W, hw, dk, M.Modern(ac="full"))
    sel = M.step(W, hw, dk, M.Modern(ac="selective"))
    assert none["flops"] == {"model": model, "hardware": model}
    assert full["flops"] == {"model": model, "hardware": pytest.approx(with_rc)}
    assert sel["flops"]["hardware"] == pytest.approx((model + with_rc) / 2)
    assert none["mfu"] == pytest.approx(model / (hw.peak_flops * none["step_s"]))
    assert none["hfu"] == none["mfu"] and full["hfu"] > full["mfu"]


def test_dp_overlap_limits():
    hw, dk = hardware("h100"), K.device_kernels("h100_sxm")
    w = dataclasses.replace(W, gpus=64)
    windows = (1.0, 2.0)
    r = M.dp_terms(w, hw, dk, windows, "mid")
    assert r["dp_exposed"] <= r["dp_total"]
    # fast links: only the first block's transfers show; slow links: the excess over compute
    fast = M.dp_terms(w, hw.scaled(intra=1e3, inter=1e3), dk, windows, "mid")
    assert fast["dp_exposed"] == pytest.approx(fast["dp_total"] / w.n_layer)
    slow = M.dp_terms(w, hw.scaled(intra=1e-3, inter=1e-3), dk, windows, "mid")
    assert slow["dp_exposed"] == pytest.approx(slow["dp_total"] - sum(windows))
    # stage 1 hides nothing; one rank has no DP traffic
    s1 = M.dp_terms(dataclasses.replace(w, stage=1), hw, dk, windows, "mid")
    assert s1["dp_exposed"] == s1["dp_total"]
    assert M.dp_terms(dataclasses.replace(w, gpus=1), hw, dk, windows, "mid")["dp_total"] == 0


def test_memory_bound_kernels_eager_in_the_middle_fused_at_the_high_edge():
    b, s, h, f, kv = 1, 8192, 4096, 14336, 1024
    eager, fused = M.layer_bytes(W, "eager"), M.layer_bytes(W, "fused")
    assert eager == (b * s * (h * 84 + (h + kv) * 20 + 2 * h * 2 + f * 10),
                     b * s * (h * 212 + (h + kv) * 20 + 2 * h * 2 + f * 26))
    assert fused[0] < eager[0] and fused[1] < eager[1]
    mid, high = _run(), M.step_terms(W, hardware("h100"), K.device_kernels("h100_sxm"),
                                     M.Modern(), "high")
    assert high["memory_bound_bwd"] < mid["memory_bound_bwd"]
    # GPT's layers have no eager / fused difference (aten's fused LayerNorm and GELU)
    g = dataclasses.replace(W, ffn=0, kv_heads=0, vocab=50304)
    assert M.layer_bytes(g, "eager") == M.layer_bytes(g, "fused")


def test_switches_are_validated():
    with pytest.raises(ValueError, match="ac="):
        M.Modern(ac="some")
    with pytest.raises(ValueError, match="attention="):
        M.Modern(attention="sparse")
    with pytest.raises(ValueError, match="every"):
        M.Modern(ac="selective", every=0)

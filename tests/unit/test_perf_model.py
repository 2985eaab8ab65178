"""Performance model: collective closed forms, FLOPs, topology, monotonicity, calibration."""
import dataclasses

import pytest

from zero_repro.runtime.model.flops import flops_per_iteration
from zero_repro.scale import calibrate as C
from zero_repro.scale import perf_model as P
from zero_repro.scale.hardware import hardware
from zero_repro.scale.hardware import list_clusters, load_cluster

HW = hardware("dgx2_v100")
PP = P.PerfParams(e_max=0.5, comm_eff=0.3)
W100 = P.Workload(n_layer=125, hidden=8192, heads=64, gpus=400, tp=16, batch_per_gpu=32,
                  stage=2, p_a=True)


@pytest.fixture(scope="module")
def cal():
    return C.fit()


def test_cluster_yamls_load_and_v100_specs():
    assert {"dgx2_v100", "dgx_a100_40g", "dgx_a100_80g", "h100", "h200", "local"} <= set(
        list_clusters())
    c = load_cluster("dgx2_v100")
    assert (c.gpus_per_node, c.device_memory_gb, c.peak_tflops) == (16, 32, 125)
    assert (c.intra_node_gbps, c.inter_node_gbps, c.device, c.backend) == (300, 800, "cuda", "nccl")
    assert HW.intra_bw == 150e9 and HW.inter_bw_node == 100e9  # per direction, bytes/s
    for name in ("dgx_a100_40g", "dgx_a100_80g", "h100", "h200"):
        h = hardware(name)
        assert h.gpus_per_node == 8 and h.peak_flops > HW.peak_flops


def test_collective_closed_forms():
    S, B, a = 1e9, 1e11, 1e-5
    for n in (2, 4, 16):
        assert P.ring_all_reduce_time(S, n, B, a) == pytest.approx(
            2 * (n - 1) / n * S / B + 2 * (n - 1) * a)
        rs = P.ring_reduce_scatter_time(S, n, B, a)
        assert rs == pytest.approx((n - 1) / n * S / B + (n - 1) * a)
        assert P.ring_all_gather_time(S, n, B, a) == rs
        assert P.ring_all_reduce_time(S, n, B, a) == pytest.approx(2 * rs)
    assert P.ring_all_reduce_time(S, 1, B, a) == 0.0


def test_topology_links():
    # MP 16 on a 16-GPU node: TP inside the node at NVSwitch speed; each DP group has one GPU
    # per node and the node's 16 groups share its NICs
    bw_tp, _ = P.tp_link(W100, HW, 0.5)
    bw_dp, _ = P.dp_link(W100, HW, 0.5)
    assert bw_tp == HW.intra_bw
    assert bw_dp == pytest.approx(HW.inter_bw_node / 16 * 0.5)
    # MP 1: one DP group per node -> the whole NIC bandwidth (capped by NVSwitch)
    w1 = dataclasses.replace(W100, tp=1)
    assert P.dp_link(w1, HW, 1.0)[0] == pytest.approx(min(HW.intra_bw, HW.inter_bw_node))
    # baseline MP 128 spans 8 nodes: TP all-reduces over InfiniBand
    wb = dataclasses.replace(W100, tp=128, gpus=384, heads=128)
    assert P.tp_link(wb, HW, 0.5)[0] == pytest.approx(HW.inter_bw_node * 0.5)
    # DP per-node NIC load is independent of MP when MP <= GPUs/node: 2(n-1)/n·Ψ·2 bytes
    for mp in (1, 4, 16):
        w = dataclasses.replace(W100, tp=mp)
        bw, _ = P.dp_link(w, HW, 1.0)
        per_node = P.ring_all_reduce_time(w.params / mp * 2, w.dp, bw) * HW.inter_bw_node
        assert per_node == pytest.approx(2 * (w.dp - 1) / w.dp * w.params * 2, rel=1e-9)


def test_flops_hand_count():
    b, s, l, h, V = 2, 128, 3, 64, 1000
    # per block fwd: QKV 2·3h², proj 2h², MLP 2·8h² per token -> 24h²·bs; scores+context 4·b·s²·h
    fwd_block = 24 * b * s * h * h + 4 * b * s * s * h
    logits = 2 * b * s * h * V
    want = 4 * fwd_block * l + 3 * logits  # fwd + 2x bwd + recompute; head not recomputed
    assert flops_per_iteration(b, s, l, h, V, recompute=True) == pytest.approx(want)
    assert P.flops_per_gpu(dataclasses.replace(W100, batch_per_gpu=b, seq=s, n_layer=l,
                                               hidden=h, heads=4, vocab=V, tp=4)) == \
        pytest.approx(want / 4)


def test_breakdown_components_add_up():
    r = P.step_time(W100, HW, PP)
    parts = ("compute", "tp_comm", "dp_comm", "pa_comm", "cpu_offload")
    assert r["total"] == pytest.approx(sum(r[k] for k in parts))
    assert all(r[k] >= 0 for k in parts) and r["pa_comm"] > 0 and r["cpu_offload"] == 0
    assert r["tflops_per_gpu"] == pytest.approx(P.flops_per_gpu(W100) / r["total"] / 1e12)
    # §8: the P_a all-gather is < 10% of Megatron's TP traffic (1 vs 12·s·h per block)
    assert r["pa_comm"] < 0.1 * r["tp_comm"]
    c5 = P.step_time(dataclasses.replace(W100, p_a_cpu=True), HW, PP)
    assert c5["cpu_offload"] > 0 and c5["total"] > r["total"]


def test_monotonic_in_bandwidth_and_batch():
    for w in (W100, dataclasses.replace(W100, tp=128, gpus=384, heads=128, stage=0, p_a=False),
              dataclasses.replace(W100, p_a_cpu=True)):
        base = P.step_time(w, HW, PP)["total"]
        for kw in ({"intra": 2}, {"inter": 2}, {"pcie": 2}):
            assert P.step_time(w, HW.scaled(**kw), PP)["total"] <= base
    prev = 0.0
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        tf = P.step_time(dataclasses.replace(W100, batch_per_gpu=b), HW, PP)["tflops_per_gpu"]
        assert tf >= prev
        prev = tf
    assert prev <= HW.peak_flops / 1e12 * PP.e_max  # compute bound


def test_baseline_internode_mp_collapses():
    zero = P.step_time(W100, HW, PP)["tflops_per_gpu"]
    base = P.step_time(dataclasses.replace(W100, tp=128, gpus=384, heads=128, stage=0,
                                           p_a=False, batch_per_gpu=2), HW, PP)["tflops_per_gpu"]
    assert zero > 5 * base


def test_nelder_mead_finds_quadratic_minimum():
    x, f = C.nelder_mead(lambda z: (z[0] - 1) ** 2 + 3 * (z[1] + 2) ** 2, [0.0, 0.0])
    assert x == pytest.approx([1, -2], abs=1e-3) and f < 1e-6


def test_gemm_shapes_sum_to_the_megatron_flops_and_tail_is_half_a_wave():
    for w in (W100, dataclasses.replace(W100, tp=4, batch_per_gpu=3, heads=32, hidden=4096),
              dataclasses.replace(W100, checkpointing=False, tp=1, n_layer=2)):
        flops = sum(c * 2 * m * n * k * bt for m, n, k, c, bt in P.gemm_shapes(w))
        assert flops == pytest.approx(P.flops_per_gpu(w), rel=1e-12)
    assert P.w_half(HW) == 0.5 * 80 * 128 * 128 and HW.sm_count == 80
    assert HW.hbm_bw == 900e9 and HW.peak_flops == 125e12  # V100 datasheet
    # saturated GEMMs run at e_max; a small batch / wide MP leaves the SMs under-filled
    big = P.compute_efficiency(W100, HW, PP)
    assert 0.95 * PP.e_max < big < PP.e_max
    small = P.compute_efficiency(dataclasses.replace(W100, batch_per_gpu=1, tp=128,
                                                     gpus=384, heads=128), HW, PP)
    assert small < 0.7 * big
    effs = [P.compute_efficiency(dataclasses.replace(W100, batch_per_gpu=b), HW, PP)
            for b in (1, 2, 8, 32)]
    assert effs == sorted(effs)


def test_memory_bound_bytes_hand_count():
    w = P.Workload(n_layer=1, hidden=8, heads=2, gpus=1, tp=1, batch_per_gpu=1, seq=4, vocab=16)
    scores, hidden, mlp, qkv, logits = 2 * 16, 4 * 8, 4 * 32, 4 * 24, 4 * 16
    want = (scores * (2 * 25 + 27) + hidden * (2 * 38 + 38) + mlp * (2 * 20 + 18)
            + qkv * (2 * 4 + 2) + logits * (46 + 14))
    assert P.memory_bound_bytes(w) == pytest.approx(want)
    r = P.step_time(W100, HW, PP)
    assert r["compute"] == pytest.approx(r["gemm"] + r["memory_bound"])
    assert r["memory_bound"] == pytest.approx(P.memory_bound_bytes(W100) / 900e9)


def test_calibration_fig2_zero_fit(cal):
    assert len(dataclasses.fields(cal.params)) <= 3 and cal.n_free == 2
    assert cal.targets == ["fig2 ZeRO"]
    assert len(cal.residuals) == 9
    # the two-parameter roofline fits Fig 2's ZeRO series within 23% (rms 13%;
    # results/fig2_throughput/notes.md)
    worst = max(abs(r["rel_err"]) for r in cal.residuals)
    assert worst <= 0.23, [(r["point"], round(r["rel_err"], 3)) for r in cal.residuals]
    assert 0 < cal.params.e_max <= 1 and 0 < cal.params.comm_eff <= 1
    # deterministic
    assert C.fit().params == cal.params


def test_predictions_fig3_superlinear_and_rows(cal):
    rows = C.predict_fig3(cal)
    tf = {r["x_value"]: r["y_value"] for r in rows}
    assert 128 * tf[128] / (64 * tf[64]) > 2.0  # super-linear 64 -> 128 (batch 16 -> 48)
    for pred in (C.predict_fig2, C.predict_fig4, C.predict_fig8):
        for r in pred(cal):
            assert r["kind"] == "simulated" and r["unit"] == "TFLOPs/GPU"
            assert 0 < r["y_value"] < HW.peak_flops / 1e12
    base = {r["x_value"]: r["y_value"] for r in C.predict_fig2(cal) if "Baseline" in r["series"]}
    zero = {r["x_value"]: r["y_value"] for r in C.predict_fig2(cal) if "ZeRO" in r["series"]}
    assert all(zero[x] > 3 * base[x] for x in zero if x >= 40)  # baseline MP crosses nodes
    errs = C.errors_vs_paper(cal)
    assert len(errs["fig2_baseline"]) == 9 and len(errs["fig3"]) == 4
    assert len(errs["fig2_speedup"]) == 9
    for r in errs["fig2_speedup"]:
        z = next(q for q in errs["fig2_zero"] if q["x"] == r["x"])
        b = next(q for q in errs["fig2_baseline"] if q["x"] == r["x"])
        assert r["simulated"] == pytest.approx(z["simulated"] / b["simulated"])


def test_2020_step_terms_rooted_reduce_and_step_passes():
    """Stage 2's rooted reduces cost the whole bucket per link (S/B, not (n-1)/n·S/B) plus
    n(n-1) ring steps per bucket; the ZeRO step's passes are STEP_BYTES per element at the HBM
    roof; P_a+cpu's synchronous copies are both exposed."""
    w = dataclasses.replace(W100, gpus=64, batch_per_gpu=16)  # DP 4
    pp = P.PerfParams(0.5, 0.5)
    base = P.step_time(w, HW, pp)
    rooted = P.step_time(dataclasses.replace(w, rooted_reduce=True), HW, pp)
    grad = w.params / w.tp * w.lp_bytes
    bw, alpha = P.dp_link(w, HW, pp.comm_eff)
    calls = -(-w.params / w.tp // w.bucket_elems)
    rs = P.ring_reduce_scatter_time(grad, 4, bw, alpha) + (calls - 1) * 3 * alpha
    assert rooted["dp_comm"] - base["dp_comm"] == pytest.approx(
        grad / bw + calls * 4 * 3 * alpha - rs)
    for commit, (part, whole) in P.STEP_BYTES.items():
        if commit == "stage1":
            continue
        s = P.step_time(dataclasses.replace(w, step_commit=commit), HW, pp)
        psi = w.params / w.tp
        assert s["zero_step"] == pytest.approx((part * psi / 4 + whole * psi) / HW.hbm_bw)
        assert s["total"] == pytest.approx(base["total"] + s["zero_step"])
    cpu = dataclasses.replace(w, p_a=True, p_a_cpu=True)
    sync = P.step_time(dataclasses.replace(cpu, pa_cpu_sync=True), HW, pp)
    ckpt = w.n_layer * w.batch_per_gpu * w.seq * w.hidden * 2 / w.tp / (HW.pcie_bw * 0.5)
    assert sync["cpu_offload"] == pytest.approx(2 * ckpt)
    assert P.step_time(cpu, HW, pp)["cpu_offload"] <= sync["cpu_offload"]

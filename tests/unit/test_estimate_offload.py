"""The estimate with ZeRO-Offload (``--offload cpu``; scale/estimate.py, scale/offload_time.py):
the dry run puts the offloaded optimizer on the host, its ledger equals Table 1's offload column
on both sides, the host is judged against the cluster's host RAM, the step is timed with the
host AdamW and the PCIe copies (and loses the device's AdamW), and the command line's errors."""
from __future__ import annotations

import dataclasses

import pytest

from zero_repro.lab import estimate as L
from zero_repro.scale import estimate as E
from zero_repro.scale import estimate_time as T
from zero_repro.scale import kernels as K
from zero_repro.scale import modern_step as M
from zero_repro.scale import offload_time as OT
from zero_repro.scale.dryrun.dryrun import dry_run
from zero_repro.scale.paper.table1 import offload_bytes

from tests.unit.test_estimate import base

L40S = T.Timing(gpu="l40s")


def host(cfg, gb: float, cores: float = 16, gbps: float = 200.0):
    return dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, host_memory_gb=gb, host_cores=cores, host_memory_gbps=gbps))


def test_the_dry_run_keeps_the_offloaded_optimizer_on_the_host():
    """Device and host ledgers equal the offload column at the padded Ψ, and the device's live
    peak drops by at least the optimizer's 12Ψ/N_d against the same stage without offload."""
    for stage in (1, 2, 3):
        plain = E.stage_config(base(), stage, "ckpt", 2)
        off = E.stage_config(base(), stage, "ckpt", 2, offload="cpu")
        a, b = (dry_run(c, keep_trace=False, details=False) for c in (plain, off))
        want = offload_bytes(b.psi_padded, stage, 4)
        assert b.model_state_bytes == want["device"]
        host = sum(v for k, v in b.ledger.items() if k.endswith("_host") and k !=
                   "optim_step_host")
        assert host == want["host"]
        assert b.host_bytes >= host  # every host storage told apart (+ the step's scratch)
        assert a.live_peak - b.live_peak >= 12 * b.psi_padded / 4, stage


def test_offload_fits_where_the_device_alone_does_not_and_the_host_is_judged():
    # a device between the two peaks: too small for stage 1's 4Ψ + 12Ψ/N_d with the
    # optimizer, large enough for 4Ψ without it (the modern stack's outside bytes added)
    roomy = host(base(mem_gb=5.0, world=2), gb=1.0)
    peaks = [E.estimate(roomy, (1,), "ckpt", search=False, workers=1, timing=L40S,
                        offload=o) for o in ("none", "cpu")]
    assert peaks[1].stages[0].peak_reserved < peaks[0].stages[0].peak_reserved
    between = (peaks[0].stages[0].peak_reserved + peaks[1].stages[0].peak_reserved) / 2
    cfg = host(base(mem_gb=(peaks[0].outside["mid"] + between) / 1e9, world=2), gb=1.0)
    plain = E.estimate(cfg, (1,), "ckpt", search=False, workers=1, timing=L40S)
    off = E.estimate(cfg, (1,), "ckpt", search=False, workers=1, timing=L40S, offload="cpu")
    assert not plain.stages[0].fits and off.stages[0].fits
    s = off.stages[0]
    assert s.offload == "cpu" and s.host_fits and s.host_bytes > 0
    assert s.table1_host == pytest.approx(offload_bytes(s.psi_rank, 1, 2)["host"], rel=1e-12)
    # a host too small: the verdict says so, and so does the recommendation
    small = E.estimate(host(cfg, gb=s.host_bytes / 2e9), (1,), "ckpt", search=False,
                       workers=1, timing=L40S, offload="cpu")
    t = small.stages[0]
    assert t.device_fits and not t.host_fits and not t.fits
    assert "host needs" in small.recommendation[1]
    # stage 0 offloads on one DP rank only: left out at DP 2
    both = E.estimate(cfg, (0, 2), "ckpt", search=False, workers=1, timing=L40S,
                      offload="cpu")
    assert [x.stage for x in both.stages] == [2]


def test_the_step_trades_the_device_adamw_for_the_host_and_pcie():
    cfg = host(E.stage_config(base(world=2), 2, "ckpt", 2), gb=100.0)
    off = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, offload_optimizer="cpu"))
    hw = T.hardware_for(cfg)
    a, b = (T.performance(c, hw, None, L40S) for c in (cfg, off))
    assert a["terms"]["host_adam"] == a["terms"]["pcie_exposed"] == 0 == a["pcie_bytes"]
    assert b["terms"]["optimizer"] == 0 < b["terms"]["host_adam"]
    w = T.workload(off)
    shard = w.params / 2
    assert b["pcie_bytes"] == pytest.approx(2 * 2 * shard)  # lp bytes each way
    bw = hw.pcie_bw * K.link_efficiency(K.device_kernels("l40s"), "pcie", "mid")
    assert b["pcie_total_s"] == pytest.approx(2 * 2 * shard / bw)
    rate = min(hw.host_cores * OT.core_rate(hw.host_lanes, hw.host_clock),
               OT.DRAM_EFFICIENCY["mid"] * hw.host_mem_bw / OT.HOST_BYTES)
    assert b["terms"]["host_adam"] == pytest.approx(shard / rate)
    # more PCIe bandwidth, more host cores: never slower
    faster = dataclasses.replace(hw, pcie_bw=4 * hw.pcie_bw, host_cores=4 * hw.host_cores)
    assert T.performance(off, faster, None, L40S)["step_s"] <= b["step_s"]
    # the DRAM roof caps the cores
    many = dataclasses.replace(hw, host_cores=1e6)
    assert OT.host_rate(many.host_cores, many.host_mem_bw) == pytest.approx(
        OT.DRAM_EFFICIENCY["mid"] * hw.host_mem_bw / OT.HOST_BYTES)
    assert set(b["terms"]) == set(M.TERMS)


def test_a_host_core_is_scaled_by_its_lanes_and_clock_from_the_in_cache_rate_measured_here():
    # the same core as this machine's at the same clock: the rate measured here
    here = OT.core_rate(OT.HERE_LANES, OT.HERE_CLOCK)
    assert here == pytest.approx(OT.HOST_ADAM_CACHE["mid"])
    # two 512-bit FMA units (Skylake-SP, Sapphire Rapids) retire twice the lanes of Zen 2/4
    wide = OT.core_rate(2 * OT.HERE_LANES, OT.HERE_CLOCK)
    assert wide == pytest.approx(2 * here)
    # the band: base over turbo below, turbo over base above
    lo, mid, hi = (OT.core_rate(32, (2.0e9, 3.8e9), p) for p in ("low", "mid", "high"))
    assert lo < mid < hi
    assert lo == pytest.approx(OT.HOST_ADAM_CACHE["low"] * 32 * 2.0 / (16 * 3.7))
    # a cluster that does not give its core: this machine's DRAM-streaming core, as before
    assert OT.core_rate(0, (0.0, 0.0)) == OT.HOST_ADAM_PER_CORE["mid"]
    # every cluster of conf/cluster/ with offload hosts gives its core, and its DRAM binds
    from zero_repro.scale.hardware import Hardware
    from zero_repro.scale.paper.clusters import list_clusters, load_cluster
    for name in list_clusters():
        hw = Hardware.from_config(load_cluster(name))
        if hw.host_cores:
            assert hw.host_lanes in (16, 32) and hw.host_clock[0] > 1e9, name
            assert OT.host_rate(hw.host_cores, hw.host_mem_bw, "low", hw.host_lanes,
                                hw.host_clock) < hw.host_cores * OT.core_rate(
                hw.host_lanes, hw.host_clock, "low"), name


def test_one_rank_on_a_node_has_the_nodes_host():
    cfg = host(base(world=1), gb=10.0, cores=4, gbps=50.0)  # 2 GPUs per node
    hw = T.hardware_for(cfg)
    assert (hw.host_bytes, hw.host_cores, hw.host_mem_bw) == (20e9, 8, 100e9)
    hw4 = T.hardware_for(host(base(world=4), gb=10.0, cores=4, gbps=50.0))
    assert (hw4.host_bytes, hw4.host_cores) == (10e9, 4)


def test_command_line_offload_errors_and_report(capsys):
    assert L.main(["--model", "llama_tiny", "--cluster", "l40s_pcie", "--gpus", "2",
                   "--offload", "nvme"]) == 2
    assert "--offload 'nvme'" in capsys.readouterr().err
    assert L.main(["--model", "llama_tiny", "--cluster", "l40s_pcie", "--gpus", "2",
                   "--stages", "2", "--offload", "none,cpu", "--no-search",
                   "--workers", "1"]) == 0
    out = capsys.readouterr().out
    for text in ("on the host: Table 1's offload column", "host verdict at",
                 "PCIe traffic per rank and step", "Host step (ZeRO-Offload)",
                 "optimizer offloaded to the host"):
        assert text in out, text


def test_deepspeed_offload_figures_follow_its_formulas():
    pytest.importorskip("deepspeed")
    ds = L.deepspeed_figures(7e9, 8, 4, 131_072_000, offload=True)
    assert ds[2] == int(2 * 7e9)  # 16-bit parameters only on the GPU
    assert ds["host"][2] == int(7e9 * max(4 * 8, 16) * 1.5)  # per node, its buffer factor


def test_the_dry_run_keeps_stage_3s_parameter_shard_on_the_host():
    """ZeRO-3 Offload (``cpu+param``): the device keeps no model state between uses, the host
    the offload column with the parameters (16Ψ/N_d); the device's live peak drops by at least
    the parameter shard against the optimizer offloaded alone; ``param`` alone keeps the
    optimizer and the gradient shard on the device."""
    cfgs = {o: E.stage_config(base(), 3, "ckpt", 2, offload=o) for o in ("cpu", "cpu+param",
                                                                          "param")}
    runs = {o: dry_run(c, keep_trace=False, details=False) for o, c in cfgs.items()}
    for mode, r in runs.items():
        opt, par = ("cpu", "cpu") if mode == "cpu+param" else (("cpu", "none") if mode == "cpu"
                                                               else ("none", "cpu"))
        want = offload_bytes(r.psi_padded, 3, 4, optimizer=opt, param=par)
        assert r.model_state_bytes == want["device"], mode
        host = sum(v for k, v in r.ledger.items() if k.endswith("_host") and k !=
                   "optim_step_host")
        assert host == want["host"], mode
        assert r.host_bytes >= host
    assert runs["cpu+param"].model_state_bytes == 0
    assert runs["cpu"].live_peak - runs["cpu+param"].live_peak >= 2 * runs["cpu"].psi_padded / 4


@pytest.mark.slow
@pytest.mark.parametrize("model,cluster,extra,offload", [
    ("gpt_13b", "dgx2_v100", "", "cpu"),  # ZeRO-Offload's headline: 13B on one 32 GB V100
    ("gpt_40b_88x6144", "dgx2_v100", "", "cpu+param"),  # ZeRO-Infinity's: 40B on one V100
    ("llama2_7b", "l40s_pcie", "24GB", "cpu+param"),  # a 24 GB card
])
def test_one_card_fits_what_the_offload_papers_say(model, cluster, extra, offload):
    """Simulated (the dry run on meta tensors, judged against the card): each fits on one GPU
    with its offload mode at micro-batch 1 and does not fit without it."""
    argv = ["--model", model, "--cluster", cluster, "--gpus", "1", "--batch", "1"]
    if extra:
        argv += ["--device-memory", extra]
    cfg = L.config_from_args(L._parser().parse_args(argv))
    stage = 2 if offload == "cpu" else 3
    on = E.estimate(cfg, (stage,), "auto", search=False, workers=1, offload=offload)
    off = E.estimate(cfg, (stage,), "auto", search=False, workers=1, offload="none")
    assert on.stages[0].fits, (model, on.stages[0].peak_reserved / 1e9)
    assert not off.stages[0].fits, (model, off.stages[0].peak_reserved / 1e9)

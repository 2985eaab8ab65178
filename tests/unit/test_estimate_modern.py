"""The estimate with the modern stack's time model (scale/estimate_time.py, scale/estimate.py):
paper2020 keeps the calibrated model as it was; the modern model keeps every term (JSON) and
reports the three largest; the bytes outside the allocator come off the device; unfused
attention and selective checkpointing move the memory as the module's formulas say; the
command line's switches and their errors."""
from __future__ import annotations

import dataclasses
import json

import pytest

from zero_repro import gpus
from zero_repro.lab import estimate as L
from zero_repro.scale import estimate as E
from zero_repro.scale import estimate_time as T
from zero_repro.scale import modern_step as M
from zero_repro.scale import outside_modern as O
from zero_repro.scale import perf_model
from zero_repro.scale.hardware import Hardware

from tests.unit.test_estimate import base

H100 = T.Timing(gpu="h100_sxm")


def _est(cfg, timing, zero_r="auto", stages=(3,), search=False):
    return E.estimate(cfg, stages, zero_r, search=search, workers=1, timing=timing)


def test_paper2020_is_the_calibrated_model_as_before():
    cfg = E.stage_config(base(), 2, "ckpt", 2)
    pp = perf_model.PerfParams(e_max=0.4, comm_eff=0.3)
    got = T.performance(cfg, Hardware.from_config(cfg.cluster), pp,
                        T.Timing(model="paper2020"))
    # the 2020 stack reduces after backward (era.OVERLAP_COMM_2020)
    want = perf_model.step_time(dataclasses.replace(T.workload(cfg), overlap_comm=False),
                                Hardware.from_config(cfg.cluster), pp)
    assert got["model"] == "paper2020" and got["step_s"] == want["total"]
    assert got["compute_s"] == want["compute"] and got["dp_s"] == want["dp_comm"]


def test_gpu_of_a_cluster():
    c = base().cluster
    assert T.gpu_of(c) == ""  # 100 TFLOP/s: no such device
    assert T.gpu_of(c, "l40s") == "l40s"
    h = dataclasses.replace(c, name="x", peak_tflops=989, device_memory_gb=141)
    assert T.gpu_of(h) == "h200_sxm"
    assert T.gpu_of(dataclasses.replace(h, device_memory_gb=80)) == "h100_sxm"
    assert T.gpu_of(dataclasses.replace(c, gpu="a100_40gb")) == "a100_40gb"  # the one it names
    # no GPU told: the paper2020 model, said so
    cfg = E.stage_config(base(), 3, "ckpt", 2)
    perf = T.performance(cfg, Hardware.from_config(cfg.cluster), None)
    assert perf["model"] == "paper2020" and "--gpu" in perf["note"]


def test_modern_estimate_keeps_every_term_and_takes_the_outside_bytes_off():
    cfg = base(mem_gb=2.0)
    est = _est(cfg, H100)
    s = est.stages[0]
    assert s.perf["model"] == "modern" and s.perf["gpu"] == "h100_sxm"
    assert set(s.perf["terms"]) == set(M.TERMS)
    assert sum(s.perf["terms"].values()) == pytest.approx(s.perf["step_s"])
    lo, hi = s.perf["step_s_band"]
    assert lo <= s.perf["step_s"] <= hi
    # gpus_per_node 2: no NVLS; one communicator
    want = O.bracket(gpus.GENERATIONS["hopper"], 1, 2)
    assert est.outside["mid"] == want["mid"] and "nvls" not in est.outside["parts"]
    assert s.capacity == pytest.approx(s.device_capacity - want["mid"])
    old = _est(cfg, T.Timing(model="paper2020")).stages[0]
    assert old.capacity == old.device_capacity and old.perf["model"] == "paper2020"
    text = L.report(est, {})
    assert "modern stack on H100-SXM5-80GB" in text and "band (s)" in text
    top = [k for k, _, _ in s.perf["largest"]]
    for k in top:
        assert L._TERM_LABEL[k] in text
    d = json.loads(json.dumps(L.as_json(est, {}), default=str))
    assert set(d["stages"][0]["perf"]["terms"]) == set(M.TERMS)


def test_unfused_attention_adds_the_probabilities_per_sample():
    cfg = base(mem_gb=2.0)
    flash = _est(cfg, H100).stages[0]
    unfused = _est(cfg, dataclasses.replace(H100, attention="unfused")).stages[0]
    m, b = cfg.model, cfg.train.micro_batch_size
    per_sample = m.n_head * m.seq_len ** 2 * (2 * m.n_layer * (1 - 1.0) + 6)  # full AC
    diff = unfused.parts["activations"] - flash.parts["activations"]
    assert diff == int(per_sample * b)
    assert unfused.peak_reserved - flash.peak_reserved == int(per_sample * b)
    assert unfused.perf["terms"]["attention_fwd"] > flash.perf["terms"]["attention_fwd"]


def test_selective_checkpointing_interpolates_the_two_dry_runs():
    cfg = base(mem_gb=2.0)
    full = _est(cfg, H100, "ckpt").stages[0]
    none = _est(cfg, H100, "none").stages[0]
    sel = _est(cfg, H100, "selective").stages[0]
    for part in E.PARTS:
        assert sel.parts[part] == int(0.5 * full.parts[part] + 0.5 * none.parts[part])
    assert sel.live_peak == sum(sel.parts.values())
    assert min(full.live_peak, none.live_peak) <= sel.live_peak <= max(full.live_peak,
                                                                       none.live_peak)
    assert sel.perf["ac"] == "selective" and sel.perf["every"] == 2
    assert none.perf["terms"]["recompute"] == 0 < sel.perf["terms"]["recompute"] < full.perf[
        "terms"]["recompute"]


def test_selective_search_finds_the_interpolated_edge():
    cfg = base(mem_gb=0.06)  # no GPU named: nothing outside the allocator, the judge is pure
    s = _est(cfg, T.Timing(), "selective", search=True).stages[0]
    assert s.max_batch >= 1

    def reserved(b):  # the interpolated peak reserved from the two plain estimates at b
        at = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=b))
        full, none = (_est(at, T.Timing(), zr).stages[0].peak_reserved for zr in ("ckpt",
                                                                                  "none"))
        return int(0.5 * full + 0.5 * none)

    assert reserved(s.max_batch) <= s.capacity < reserved(s.max_batch + 1)


@pytest.mark.parametrize("argv,msg", [
    (["--model", "llama2_7b", "--gpus", "8", "--cluster", "h100", "--ac", "none",
      "--zero-r", "ckpt"], "give one of them"),
    (["--model", "llama2_7b", "--gpus", "8", "--cluster", "h100", "--ac", "full",
      "--zero-r", "none"], "give one of them"),
    (["--model", "llama2_7b", "--gpus", "8", "--cluster", "h100", "--gpu", "b200"],
     "use one of"),
    (["--model", "llama2_7b", "--gpus", "8", "--cluster", "h100", "--ac", "selective",
      "--every", "0"], "every"),
])
def test_bad_switches_are_one_error_line(argv, msg, capsys):
    assert L.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and msg in err[0], err


def test_settings_of_the_ac_switch():
    ns = L._parser().parse_args
    tp1 = 1
    assert L.settings_of(ns(["--gpus", "8", "--ac", "selective"]), tp1) == ["selective"]
    assert L.settings_of(ns(["--gpus", "8", "--ac", "none"]), tp1) == ["none"]
    assert L.settings_of(ns(["--gpus", "8", "--ac", "full"]), tp1) == ["auto"]
    assert L.settings_of(ns(["--gpus", "8"]), tp1) == ["auto"]
    # a switch that contradicts --zero-r is refused, not silently overridden
    with pytest.raises(ValueError, match="give one of them"):
        L.settings_of(ns(["--gpus", "8", "--ac", "none", "--zero-r", "pa"]), tp1)
    with pytest.raises(ValueError, match="give one of them"):
        L.settings_of(ns(["--gpus", "8", "--ac", "full", "--zero-r", "none"]), tp1)

"""Peers: torch DDP, DDP + ZeroRedundancyOptimizer, FSDP2 and this project's stages 0-3 train the
same tiny GPT as a single-process torch AdamW reference (fp32, world 2); DeepSpeed ZeRO 1-3
likewise when DeepSpeed is installed. Also the report logic on synthetic results.

Tolerances (fp32, tiny GPT, lr 3e-3, eps 1e-3, 4 steps): |Δloss| <= 1e-5 per step and
max |θ - θ_ref| <= 2e-5 per step over every rank's elements. eps is large on purpose: with the
default 1e-8 AdamW normalises the gradient away, so a gradient off by a constant factor (sum
instead of mean over DP ranks) would move parameters by ~1e-8 only; with eps 1e-3 it moves them
by ~10% of an update (~3e-4), far beyond the tolerance.
"""
from __future__ import annotations

import math

import pytest
import torch

from zero_repro.config import ModelConfig, TrainConfig, ZeroConfig
from zero_repro.distributed.launch import spawn
from zero_repro.peers import report
from zero_repro.peers.runners import (DEEPSPEED_PEERS, OURS, TORCH_PEERS, PeerSpec, Reference,
                                      digest, run_peers)

TINY = ModelConfig(name="tiny", n_layer=2, n_embd=64, n_head=4, seq_len=64, vocab_size=512,
                   vocab_pad_multiple=8)
PSI = 136_960  # tiny GPT parameter count (vocab 512, seq 64, 2 x 64)
LOSS_TOL, PARAM_TOL = 1e-5, 2e-5


def _spec(frameworks, steps=4) -> PeerSpec:
    train = TrainConfig(steps=steps, warmup_steps=2, micro_batch_size=2, lr=3e-3, eps=1e-3,
                        weight_decay=0.1, progress=False)
    # small buckets: several buckets per stage, so bucket boundaries are exercised
    zero = ZeroConfig(grad_clip=0.0, reduce_bucket_size=50_000, allgather_bucket_size=50_000)
    return PeerSpec(TINY, train, zero, frameworks=tuple(frameworks))


def _check_equivalent(eq: dict, names) -> None:
    assert set(eq) == set(names)
    for name, e in eq.items():
        assert e["first_divergence"] is None, (name, e["first_divergence"])
        assert max(e["abs_dloss"]) <= LOSS_TOL, (name, e["abs_dloss"])
        assert all(d is not None and d <= PARAM_TOL for d in e["max_abs_dparam"]), (
            name, e["max_abs_dparam"], e["worst_at"])
        # training happened: the loss moved away from the first step's
        assert e["losses"][-1] != e["losses"][0]


def _dp_volume(trace_comm: dict, op: str) -> int:
    return trace_comm.get(f"{op}/dp", {}).get("volume", 0)


def test_torch_peers_and_our_stages_match_reference():
    names = TORCH_PEERS + OURS
    results = spawn(run_peers, 2, _spec(names))
    eq = report.equivalence(results, lr=3e-3)
    _check_equivalent(eq, names)
    fw = min(results, key=lambda r: r["rank"])["frameworks"]
    # communication of one step (paper §7 volumes, comm.py convention: all-reduce counts 2n)
    assert _dp_volume(fw["torch_ddp"]["comm"], "all_reduce") == 2 * PSI
    assert _dp_volume(fw["fsdp2_reshard"]["comm"], "all_gather") == 2 * PSI
    assert _dp_volume(fw["fsdp2_reshard"]["comm"], "reduce_scatter") == PSI
    assert _dp_volume(fw["fsdp2_no_reshard"]["comm"], "all_gather") == PSI
    for k, total in ((0, 2), (1, 2), (2, 2), (3, 3)):
        c = fw[f"zero_repro_s{k}"]["comm"]
        vol = sum(v["volume"] for key, v in c.items() if key.endswith("/dp"))
        assert vol == total * PSI, (k, c)
    # memory held per rank: sharded optimizer state / parameters take half of DDP's
    ddp = fw["torch_ddp"]["memory"]
    assert ddp["params"] == 4 * PSI and ddp["optimizer"] >= 8 * PSI
    assert fw["torch_zero_redundancy"]["memory"]["optimizer"] < 0.6 * ddp["optimizer"]
    assert fw["fsdp2_reshard"]["memory"]["params"] == 2 * PSI
    s3 = fw["zero_repro_s3"]["memory"]
    assert s3["adam_m"] + s3["adam_v"] < 0.6 * ddp["optimizer"]
    # every timed step has a time; the comm-counted warm-up step has none
    assert all(math.isnan(t["step_times"][1]) for t in fw.values())
    sp = report.speed(results, warmup_steps=2)
    assert all(sp[n]["timed_steps"] == 2 and sp[n]["step_time_s"] > 0 for n in names)


@pytest.mark.slow  # ~20-60 s: DeepSpeed's import and engine set-up (and a one-time op build)
def test_deepspeed_peers_match_reference():
    pytest.importorskip("deepspeed", reason="DeepSpeed is optional (DS_BUILD_OPS=0 pip install "
                                            "deepspeed); CI does not install it")
    names = ("torch_ddp",) + DEEPSPEED_PEERS
    results = spawn(run_peers, 2, _spec(names, steps=3))
    _check_equivalent(report.equivalence(results, lr=3e-3), names)


def test_digest_names_the_diverging_tensor():
    spec = _spec(("torch_ddp",))
    ref = Reference(spec, 0, 1)
    other = Reference(spec, 0, 1)
    snapshot = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    assert digest(other, snapshot) == (0.0, digest(other, snapshot)[1])
    with torch.no_grad():
        other.model.blocks[1].mlp.fc.weight[3, 5] += 0.25
    d, where = digest(other, snapshot)
    assert where == "blocks.1.mlp.fc.weight" and d == pytest.approx(0.25)


def _fake_results(bad_rank: int, bad_step: int) -> list[dict]:
    out = []
    for rank in range(2):
        def trace(times, stage_bad=False):
            dparam = [(1e-7, "wte.weight")] * 3
            if stage_bad and rank == bad_rank:
                dparam[bad_step] = (0.5, "blocks.0.attn.qkv.weight")
            return {"losses": [2.0, 1.9, 1.8], "step_times": times, "dparam": dparam}

        out.append({"rank": rank, "reference_losses": [2.0, 1.9, 1.8], "frameworks": {
            "torch_ddp": trace([9.0, 1.0, 1.0]),
            "torch_zero_redundancy": trace([9.0, 2.0, 2.2]),
            "deepspeed_z1": trace([9.0, 1.6, 1.6]),
            "zero_repro_s1": trace([9.0, 1.2, 1.5 if rank else 1.3], stage_bad=True)}})
    return out


def test_report_first_divergence_and_ratios():
    results = _fake_results(bad_rank=1, bad_step=1)
    eq = report.equivalence(results, lr=1e-3)
    fd = eq["zero_repro_s1"]["first_divergence"]
    assert (fd["step"], fd["tensor"], fd["rank"]) == (1, "blocks.0.attn.qkv.weight", 1)
    assert eq["torch_ddp"]["equivalent"] and not eq["zero_repro_s1"]["equivalent"]
    sp = report.speed(results, warmup_steps=1)
    ours = sp["zero_repro_s1"]
    # slowest rank per step: 1.2, 1.5 -> median 1.35; best stage-1 peer: deepspeed_z1 1.6
    assert ours["step_time_s"] == pytest.approx(1.35)
    assert ours["best_peer"] == "deepspeed_z1"
    assert ours["ratio_to_best_peer"] == pytest.approx(1.35 / 1.6)
    assert ours["goal_met"] is True  # 0.84 <= 0.9
    assert sp["deepspeed_z1"]["best_peer"] == "torch_zero_redundancy"
    assert sp["torch_zero_redundancy"]["ratio_to_ddp"] == pytest.approx(2.1)
    text = report.format_report(eq, sp)
    assert "DIVERGES at step 1 in blocks.0.attn.qkv.weight (rank 1)" in text


def test_deepspeed_absent_is_skipped_with_a_message(monkeypatch):
    import importlib.util
    import sys

    from experiments import peers as exp
    from zero_repro.config import Config
    from zero_repro.peers import runners

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    ok, why = runners.deepspeed_available()
    assert not ok and "pip install deepspeed" in why
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "deepspeed" else real(n, *a))
    cfg = Config()
    cfg.parallel.tp = 1
    cfg.experiment.params = {"frameworks": ["torch_ddp", "deepspeed_z2", "zero_repro_s2"]}
    (point,) = exp.plan(cfg)
    assert point.params["frameworks"] == ["torch_ddp", "zero_repro_s2"]

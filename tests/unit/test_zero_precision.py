"""Mixed precision, loss scaling and the single-process pieces of ZeRO-DP (paper §3.1, §5).

- fp16 and bf16 runs of every stage track the fp32 loss, and stages agree with each other;
- an inf injected into one rank's gradients makes every rank skip the step, the fp16 loss
  scale halves, and the parameters stay unchanged and finite;
- DynamicLossScaler window/hysteresis (halving does not refill the hysteresis budget);
- a genuine fp16 overflow streak (loss scale far too large) leaves no trace: on every skipped
  step parameters, fp32 master, Adam m/v and step count are bitwise unchanged, and the first
  applied step equals the same step of a run that started at the scale it backed off to;
- N_d = 1 ledgers vs Table 1; stage-3 misuse errors.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.unit.test_zero_equivalence import CFG, MICRO, SEED, batch, make, worker
from zero_repro.config import TrainConfig, ZeroConfig
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.model.gpt import GPT
from zero_repro.scale.paper.table1 import model_state_bytes
from zero_repro.runtime.zero import build_strategy
from zero_repro.runtime.zero.precision import DynamicLossScaler

LOSS_TOL = {"fp16": 0.02, "bf16": 0.06}  # |loss - fp32 loss| over 6 steps at lr 3e-3 (one batch, memorised)


def precision_configs() -> list[dict]:
    cs = [{"stage": s, "steps": 6, "dtype": d, "compare": False, "fixed_batch": True, "lr": 3e-3}
          for d in ("fp32", "fp16", "bf16") for s in range(4)]
    cs += [{"stage": s, "steps": 3, "dtype": "fp16", "compare": False, "inject_step": 1,
            "scale_power": 10} for s in range(4)]
    return cs


def _world2(rank: int, world: int, configs: list[dict], stages: list[int]) -> tuple:
    """The precision configs (``worker``), then the overflow streaks (``overflow_worker``) on
    the same pair of ranks; every run builds its own Topology and strategy."""
    return worker(rank, world, configs), overflow_worker(rank, world, stages)


OVERFLOW_STAGES = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def world2_both():
    """``_world2`` per rank: one spawn of two ranks for every distributed test here."""
    return spawn(_world2, 2, precision_configs(), OVERFLOW_STAGES)


@pytest.fixture(scope="module")
def world2_results(world2_both):
    return precision_configs(), [r[0] for r in world2_both]


def test_low_precision_tracks_fp32(world2_results):
    configs, results = world2_results
    by = {(c["dtype"], c["stage"]): r for c, r in zip(configs, results[0])
          if "inject_step" not in c}
    for dtype, tol in LOSS_TOL.items():
        for s in range(4):
            lp, ref = by[(dtype, s)]["losses"], by[("fp32", s)]["losses"]
            assert not any(i[0] for i in by[(dtype, s)]["infos"]), f"{dtype} stage {s} skipped"
            worst = max(abs(a - b) for a, b in zip(lp, ref))
            assert worst <= tol, f"{dtype} stage {s}: loss differs from fp32 by {worst:.4f}"
            # the loss must actually move (training happens), and all stages agree
            assert lp[-1] < lp[0] - 1e-3, f"{dtype} stage {s}: loss did not decrease {lp}"
            other = by[(dtype, 0)]["losses"]
            gap = max(abs(a - b) for a, b in zip(lp, other))
            assert gap <= tol / 2, f"{dtype}: stage {s} vs stage 0 loss gap {gap:.4f}"


def test_inf_on_one_rank_skips_step_everywhere(world2_results):
    configs, results = world2_results
    for i, c in enumerate(configs):
        if "inject_step" not in c:
            continue
        for rank, rank_results in enumerate(results):
            r = rank_results[i]
            skipped = [info[0] for info in r["infos"]]
            assert skipped == [False, True, False], f"stage {c['stage']} rank {rank}: {skipped}"
            scales = [info[2] for info in r["infos"]]
            assert scales[2] == scales[1] / 2, f"stage {c['stage']}: scale {scales}"
            assert r["unchanged"] == 0.0, f"stage {c['stage']}: params moved on a skipped step"
            assert r["finite"], f"stage {c['stage']}: non-finite parameters"


def test_dynamic_loss_scaler_window_and_hysteresis():
    s = DynamicLossScaler(2.0 ** 8, window=3, min_scale=64.0, hysteresis=2)
    s.update(True)
    assert s.scale == 256.0  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 128.0
    for _ in range(3):
        s.update(False)
    assert s.scale == 256.0  # doubled after a clean window
    for _ in range(10):
        s.update(True)
    assert s.scale == 64.0  # floored at min_scale
    s2 = DynamicLossScaler(4.0, 1, 1.0, 1)
    s2.load_state_dict(s.state_dict())
    assert s2.scale == 64.0


def test_hysteresis_budget_not_refilled_by_halving():
    # hysteresis 2 (DeepSpeed/Megatron semantics): one overflow tolerated, then every overflow
    # halves until a clean window restores the budget. Backing off k powers of two costs 1 + k
    # skipped steps; refilling the budget at each halving made it 2k (fig5 at 2^16: 4 skips)
    s = DynamicLossScaler(2.0 ** 16, window=4, min_scale=1.0, hysteresis=2)
    scales = []
    for _ in range(4):
        s.update(True)
        scales.append(s.scale)
    assert scales == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14, 2.0 ** 13]
    for _ in range(3):
        s.update(False)
    s.update(True)  # a good step does not refill the budget either: only a clean window
    assert s.scale == 2.0 ** 12
    for _ in range(4):
        s.update(False)
    assert s.scale == 2.0 ** 13  # clean window: doubled, budget restored
    s.update(True)
    assert s.scale == 2.0 ** 13  # tolerated again
    s.update(True)
    assert s.scale == 2.0 ** 12
    s3 = DynamicLossScaler(1.0, 1, 1.0, 2)  # an exhausted budget survives a checkpoint
    s3.load_state_dict(s.state_dict())
    s3.update(True)
    assert s3.scale == 2.0 ** 11


# ------------------------------------------------------------------ genuine overflow streak
OVERFLOW_POWER = 24  # far above what the tiny model's fp16 gradients tolerate: a skip streak
MAX_STREAK = 24


def _fp16_strategy(stage: int, power: int):
    topo = Topology.build(1)
    model = GPT(CFG, topo.tp_group)
    model.init_weights(SEED)
    zero = ZeroConfig(stage=stage, dtype="fp16", reduce_bucket_size=6000,
                      allgather_bucket_size=6000, initial_scale_power=power, hysteresis=2)
    train = TrainConfig(micro_batch_size=MICRO, lr=3e-3, eps=1e-6, weight_decay=0.1)
    return topo, build_strategy(model, topo, zero, train)


def _state(strat) -> list[torch.Tensor]:
    """Everything a step may change on this rank: owned fp16 shard, fp32 master, m, v."""
    lp = [c.detach().clone() for c in strat.params.chunks()]
    opt = strat.opt
    return lp + [opt.master.clone(), opt.exp_avg.clone(), opt.exp_avg_sq.clone()]


def _one_step(strat, topo, step: int):
    idx, tgt = batch(step, topo.dp * MICRO)
    r0 = topo.dp_rank * MICRO
    _, loss = strat(idx[r0:r0 + MICRO], tgt[r0:r0 + MICRO])
    strat.backward(loss)
    info = strat.step()
    strat.zero_grad()
    return info


def overflow_worker(rank: int, world: int, stages: list[int]) -> list[dict]:
    out = []
    for stage in stages:
        topo, a = _fp16_strategy(stage, OVERFLOW_POWER)
        infos, moved, step = [], [], 0
        while step < MAX_STREAK:
            before, n_adam = _state(a), a.opt.step_count
            info = _one_step(a, topo, step)
            infos.append((info.skipped, info.loss_scale))
            if not info.skipped:
                break
            after = _state(a)
            moved.append(a.opt.step_count != n_adam or
                         any(not torch.equal(x, y) for x, y in zip(before, after)))
            step += 1
        # the same step from a fresh run that starts at the scale the streak backed off to:
        # a skip streak must leave no trace (no partial update, stale bucket, Adam state)
        power = int(round(math.log2(infos[-1][1])))
        topo_b, b = _fp16_strategy(stage, power)
        info_b = _one_step(b, topo_b, step)
        same = not info_b.skipped and all(torch.equal(x, y)
                                          for x, y in zip(_state(a), _state(b)))
        out.append({"infos": infos, "moved": moved, "same_as_fresh": same,
                    "adam_steps": a.opt.step_count})
        a.remove_hooks()
        b.remove_hooks()
    return out


def test_overflow_streak_leaves_no_trace(world2_both):
    stages = OVERFLOW_STAGES
    results = [r[1] for r in world2_both]
    for i, stage in enumerate(stages):
        ref = results[0][i]["infos"]
        for rank, rank_results in enumerate(results):
            r = rank_results[i]
            label = f"stage {stage} rank {rank}"
            assert r["infos"] == ref, f"{label}: ranks disagree on skips {r['infos']} vs {ref}"
            skips = [sk for sk, _ in r["infos"]]
            assert len(skips) >= 4 and skips[-1] is False and all(skips[:-1]), (
                f"{label}: expected a streak of skips then an applied step, got {skips}")
            # hysteresis 2: first overflow tolerated, then one halving per overflow
            scales = [sc for _, sc in r["infos"]]
            want = [2.0 ** OVERFLOW_POWER] * 2 + [2.0 ** (OVERFLOW_POWER - k)
                                                  for k in range(1, len(scales) - 1)]
            assert scales == want, f"{label}: loss scales {scales}, expected {want}"
            assert not any(r["moved"]), f"{label}: state changed on skipped steps {r['moved']}"
            assert r["adam_steps"] == 1, f"{label}: {r['adam_steps']} Adam steps, expected 1"
            assert r["same_as_fresh"], (f"{label}: first applied step after the skips differs "
                                        f"from a fresh run at the backed-off scale")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_single_rank_ledger_matches_table1(stage):
    topo, model, strat, _ = make({"stage": stage, "dtype": "fp16"})
    psi = sum(p.numel() for p in model.parameters())
    led = strat.memory_ledger()
    assert isinstance(led, MemoryLedger)
    ratio = led.model_states() / model_state_bytes(psi, stage, 1)
    assert 1.0 <= ratio <= 1.01, f"stage {stage}: {led} ratio {ratio}"
    assert 4 * psi <= led.get("master_fp32") <= 4 * psi * 1.01  # fp16: separate fp32 master
    _, _, strat32, _ = make({"stage": stage, "dtype": "fp32"})
    assert strat32.memory_ledger().get("master_fp32") == 0  # fp32: params are the master


def test_stage3_direct_loss_backward_names_the_unit():
    topo, model, strat, _ = make({"stage": 3})
    idx, tgt = batch(0, 2)
    _, loss = strat(idx, tgt)
    with pytest.raises(RuntimeError, match="unit '(wte|wpe|ln_f|root|blocks\\.\\d+)'"):
        loss.backward()  # bypasses strategy.backward: the root unit is not gathered


def test_state_dict_roundtrip_restores_training():
    _, _, a, _ = make({"stage": 2})
    _, _, b, _ = make({"stage": 2, "lr": 5e-3})
    for step in range(2):
        idx, tgt = batch(step, 2)
        _, loss = a(idx, tgt)
        a.backward(loss)
        a.step()
        a.zero_grad()
    b.load_state_dict(a.state_dict())
    pa, pb = a.full_parameters(), b.full_parameters()
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert b.state_dict()["step"] == 2
    assert b.state_dict()["groups"][0]["shard_ranges"] == a.state_dict()["groups"][0]["shard_ranges"]

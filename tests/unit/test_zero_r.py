"""ZeRO-R activation side (paper §6, Table 3): activation checkpointing, P_a, P_a+cpu, M_D.

One world-4 gloo spawn covers TP 4 (DP 1), TP 2 x DP 2 and TP 1 (DP 4); everything else runs
in-process. Checks: parameters after AdamW steps equal across {no checkpointing, plain
checkpointing, P_a, P_a+cpu, M_D and their combinations} (max |delta| <= 1e-6, fp32);
measured checkpoint bytes (P_a = plain / m, P_a+cpu = 0 on the device and the P_a amount on
CPU); the comm ledger (P_a adds exactly one TP all-gather of B*S*H elements per block in
backward, nothing else); the Table 3 Hydra configs; arena reuse and its errors.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from tests import ROOT
from zero_repro.config import (
    ModelConfig,
    TrainConfig,
    ZeroConfig,
    ZeroRConfig,
)
from zero_repro.schema import register_configs, to_config
from zero_repro.validation import validate
from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.train.step import train_step
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.model.gpt import GPT, gather_full_state
from zero_repro.scale.paper.table3 import TABLE3, zero_overrides, zero_r_config
from zero_repro.runtime.zero import build_strategy
from zero_repro.runtime.zero_r import arena as arena_module
from zero_repro.runtime.zero_r.arena import pinned_layout
from zero_repro.runtime.zero_r import (
    CheckpointArena,
    apply_activation_checkpointing,
    canonical_name,
    fragmentation_stats,
)

MODEL = dict(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=96, vocab_pad_multiple=8)
BATCH = 2
STEPS = 3
TOL = 1e-6
VARIANTS = {  # name -> ZeroRConfig kwargs (None: no activation checkpointing at all)
    "none": None,
    "ckpt": dict(),
    "md": dict(contiguous_memory=True),
    "pa": dict(partition_activations=True),
    "pa_md": dict(partition_activations=True, contiguous_memory=True),
    "pa_cpu": dict(partition_activations=True, cpu_checkpointing=True),
    "pa_cpu_md": dict(partition_activations=True, cpu_checkpointing=True, contiguous_memory=True),
}

STRATEGY_VARIANTS = ("none", "ckpt", "pa", "pa_cpu_md")


def _zr(kw: dict | None) -> ZeroRConfig:
    return ZeroRConfig(name="custom", activation_checkpointing=kw is not None, **(kw or {}))


def _batch(step: int, dp_rank: int, cfg: ModelConfig):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)  # same within a TP group
    idx = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _diff(before: dict, after: dict) -> dict:
    out = {}
    for key in set(before) | set(after):
        a, b = before.get(key, {}), after.get(key, {})
        d = {f: b.get(f, 0) - a.get(f, 0) for f in ("calls", "elements")}
        if any(d.values()):
            out[key] = d
    return out


def _train(topo: Topology, kw: dict | None) -> dict:
    """AdamW on the GPT directly (DP gradients averaged by hand); returns full params etc."""
    cfg = ModelConfig(**MODEL)
    model = GPT(cfg, topo.tp_group, seed=7)
    handle = apply_activation_checkpointing(model, topo, _zr(kw))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    fwd = bwd = None
    for step in range(STEPS):
        idx, tgt = _batch(step, topo.dp_rank, cfg)
        start = topo.ledger.as_dict()
        _, loss = model(idx, tgt)
        mid = topo.ledger.as_dict()
        loss.backward()
        end = topo.ledger.as_dict()
        if step == 0:
            fwd, bwd = _diff(start, mid), _diff(mid, end)
        # plain DP: average gradients, in one all-reduce of them all (one collective per
        # parameter made the DP 4 runs spend most of their time waiting on peers)
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, topo.dp_group)
        flat.div_(topo.dp)
        for g, avg in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(avg.view_as(g))
        opt.step()
        opt.zero_grad(set_to_none=True)
    ledger = MemoryLedger()
    handle.add_to_ledger(ledger)
    full = {canonical_name(k): v for k, v in gather_full_state(model, topo.tp_group).items()}
    return dict(params=full, memory=handle.memory(), ledger=ledger.as_dict(), fwd=fwd, bwd=bwd)


def _train_strategy(topo: Topology, stage: int, kw: dict | None, model_kw: dict = MODEL,
                    dtype: str = "fp32") -> dict:
    """Same run through the ZeRO-DP strategy of ``stage`` (checkpointing applied before it)."""
    cfg = ModelConfig(**model_kw)
    model = GPT(cfg, topo.tp_group, seed=7)
    handle = apply_activation_checkpointing(model, topo, _zr(kw))
    strategy = build_strategy(model, topo, ZeroConfig(stage=stage, dtype=dtype),
                              TrainConfig(lr=1e-2, weight_decay=0.1), _zr(kw))
    for step in range(STEPS):
        train_step(strategy, [_batch(step, topo.dp_rank, cfg)])
    params = {canonical_name(k): v for k, v in strategy.full_parameters().items()}
    return dict(params=params, memory=handle.memory())


class _Toy(nn.Module):
    """Block inputs of 15 elements: not a multiple of the TP degree 4, so P_a pads."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.blocks = nn.ModuleList(nn.Linear(5, 5) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return (x * x).sum()


def _toy_grads(topo: Topology, kw: dict | None):
    model = _Toy()
    handle = apply_activation_checkpointing(model, topo, _zr(kw))
    x = torch.linspace(-1, 1, 15).view(1, 3, 5).requires_grad_(True)
    before = topo.ledger.as_dict()
    model(x).backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    return grads, handle.memory(), _diff(before, topo.ledger.as_dict())


def _worker(rank: int, world: int) -> dict:
    out = {}
    for tp in (4, 2, 1):
        topo = Topology.build(tp=tp)
        out[tp] = {name: _train(topo, kw) for name, kw in VARIANTS.items()}
        for r in out[tp].values():  # keep the pickle small: max |delta| vs "none" only
            r["delta"] = max((r["params"][k] - out[tp]["none"]["params"][k]).abs().max().item()
                             for k in r["params"])
        for r in out[tp].values():
            r.pop("params")
    topo = Topology.build(tp=2)  # TP 2 x DP 2 through ZeRO-DP stages 1-3
    out["stages"] = {}
    for stage in (1, 2, 3):
        runs = {name: _train_strategy(topo, stage, VARIANTS[name]) for name in STRATEGY_VARIANTS}
        out["stages"][stage] = {
            name: dict(memory=r["memory"], delta=max(
                (r["params"][k] - runs["none"]["params"][k]).abs().max().item()
                for k in r["params"])) for name, r in runs.items()}
    topo = Topology.build(tp=4)
    ref, _, _ = _toy_grads(topo, {})
    out["toy"] = {}
    for name in ("pa", "pa_md", "pa_cpu_md"):
        g, mem, comm_delta = _toy_grads(topo, VARIANTS[name])
        out["toy"][name] = dict(delta=max((a - b).abs().max().item() for a, b in zip(g, ref)),
                                memory=mem, comm=comm_delta)
    return out


@pytest.fixture(scope="module")
def dist_results():
    return spawn(_worker, 4, join_timeout_s=240)


def test_parameters_equal_across_variants(dist_results):
    for rank, res in enumerate(dist_results):
        for tp in (4, 2, 1):
            for name, r in res[tp].items():
                assert r["delta"] <= TOL, (rank, tp, name, r["delta"])


def test_parameters_equal_with_zero_stages(dist_results):
    part = MODEL["n_layer"] * BATCH * MODEL["seq_len"] * MODEL["n_embd"] * 4 // 2
    for rank, res in enumerate(dist_results):
        for stage, runs in res["stages"].items():
            assert set(runs) == set(STRATEGY_VARIANTS)
            for name, r in runs.items():
                assert r["delta"] <= TOL, (rank, stage, name, r["delta"])
            assert runs["pa"]["memory"]["ckpt_device"] == part
            assert runs["pa_cpu_md"]["memory"]["ckpt_cpu"] == part


def test_checkpoint_bytes_measured(dist_results):
    h, s, n = MODEL["n_embd"], MODEL["seq_len"], MODEL["n_layer"]
    full = n * BATCH * s * h * 4  # fp32 block inputs of every block, one rank
    for res in dist_results:
        for tp in (4, 2, 1):
            mem = {k: v["memory"] for k, v in res[tp].items()}
            assert mem["none"] == {}
            assert mem["ckpt"] == dict(ckpt_device=full, ckpt_cpu=0, arena_capacity=0,
                                       arena_used=0)
            assert mem["md"] == dict(ckpt_device=full, ckpt_cpu=0, arena_capacity=full,
                                     arena_used=full)
            part = full // tp  # B*S*H divides by tp here: no padding
            assert mem["pa"] == dict(ckpt_device=part, ckpt_cpu=0, arena_capacity=0, arena_used=0)
            assert mem["pa_md"] == dict(ckpt_device=part, ckpt_cpu=0, arena_capacity=part,
                                        arena_used=part)
            assert mem["pa_cpu"] == dict(ckpt_device=0, ckpt_cpu=part, arena_capacity=0,
                                         arena_used=0)
            assert mem["pa_cpu_md"] == dict(ckpt_device=0, ckpt_cpu=part, arena_capacity=part,
                                            arena_used=part)
            assert res[tp]["pa_cpu_md"]["ledger"]["ckpt_cpu"] == part


def test_comm_ledger_pa_adds_one_tp_allgather_per_block(dist_results):
    h, s, n = MODEL["n_embd"], MODEL["seq_len"], MODEL["n_layer"]
    for res in dist_results:
        for tp in (4, 2, 1):
            base = res[tp]["ckpt"]
            assert res[tp]["none"]["fwd"] == base["fwd"]
            for name in ("pa", "pa_md", "pa_cpu", "pa_cpu_md", "md"):
                r = res[tp][name]
                assert r["fwd"] == base["fwd"], (tp, name)  # forward moves nothing extra
                extra = _diff(base["bwd"], r["bwd"])
                if name == "md" or tp == 1:
                    assert extra == {}, (tp, name, extra)
                else:
                    assert extra == {"all_gather/tp": dict(calls=n, elements=n * BATCH * s * h)}


def test_padding_when_tp_does_not_divide(dist_results):
    for res in dist_results:
        for name, r in res["toy"].items():
            assert r["delta"] <= TOL, (name, r["delta"])
            # 15 elements -> 4 per rank (padded to 16), 2 blocks, fp32
            placed = r["memory"]["ckpt_cpu" if "cpu" in name else "ckpt_device"]
            assert placed == 2 * 4 * 4
            assert r["comm"] == {"all_gather/tp": dict(calls=2, elements=2 * 16)}


def test_arena_pointer_stable_across_steps():
    cfg = ModelConfig(**MODEL)
    model = GPT(cfg, seed=1)
    handle = apply_activation_checkpointing(model, None, _zr(dict(contiguous_memory=True)))
    ptrs, calls = [], []
    # a pre-hook: the recompute stops early once the last saved tensor is rebuilt, so a
    # forward (post) hook would not see it
    model.blocks[0].block.register_forward_pre_hook(lambda *a: calls.append(1))
    for step in range(3):
        idx, tgt = _batch(step, 0, cfg)
        model(idx, tgt)[1].backward()
        ptrs.append(handle.arena.storage_ptr())
    assert ptrs[0] != 0 and len(set(ptrs)) == 1
    assert len(calls) == 6  # forward + recompute: checkpointing really recomputes


def test_arena_errors_on_shape_change_and_overflow():
    cfg = ModelConfig(**MODEL)
    model = GPT(cfg, seed=1)
    apply_activation_checkpointing(model, None, _zr(dict(contiguous_memory=True)))
    idx, tgt = _batch(0, 0, cfg)
    model(idx, tgt)[1].backward()
    with pytest.raises(ValueError, match="geometry changed"):
        model(idx[:1], tgt[:1])
    model2 = GPT(cfg, seed=1)
    apply_activation_checkpointing(model2, None, _zr(dict(contiguous_memory=True)))
    _, keep = model2(idx, tgt)  # graph kept alive: its checkpoints stay in the arena
    with pytest.raises(ValueError, match="overflow"):
        model2(idx, tgt)
    arena = CheckpointArena(2)
    a, b = arena.take(4, torch.float32, "cpu"), arena.take(4, torch.float32, "cpu")
    assert b.data_ptr() - a.data_ptr() == 16 and arena.used_bytes == 32
    arena.reset()
    assert arena.take(4, torch.float32, "cpu").data_ptr() == a.data_ptr()
    if not torch.cuda.is_available():
        assert fragmentation_stats() == {}  # allocator stats exist only on CUDA


@pytest.mark.parametrize("n,slot", [(125, int(4.2 * 2**30) // 125), (50, 3 * 2**20 + 512),
                                    (7, 2**20), (1000, 12345), (3, 3), (1, 1000)])
def test_pinned_layout_is_power_of_two_blocks(n, slot):
    """A pinned arena's blocks are exactly powers of two (the pinned allocator rounds a request
    up to one, arena.py), hold every slot whole, and pin no more than one rounded allocation."""
    layout = pinned_layout(n, slot)
    assert sum(k for k, _ in layout) == n and len(layout) <= n.bit_length()
    assert all(b & (b - 1) == 0 and k >= 1 and k * slot <= b for k, b in layout)
    rounded = 1 << (n * slot - 1).bit_length()
    assert sum(b for _, b in layout) <= min(rounded, n * slot + len(layout) * slot)
    if (n, slot) == (125, int(4.2 * 2**30) // 125):  # 4.2 GiB: one allocation pins 8 GiB
        assert rounded / (n * slot) > 1.9 and sum(b for _, b in layout) / (n * slot) < 1.02


def test_pinned_arena_pins_power_of_two_blocks(monkeypatch):
    """P_a+cpu's arena on a CUDA machine: pinned requests of power-of-two bytes only (none
    rounded up), together less than the one request of n x slot bytes would pin; slots in
    distinct, non-overlapping places, the same ones again after ``reset``."""
    asked = []

    def host_block(numel, dtype, device, pin):
        asked.append((numel * dtype.itemsize, pin))
        return torch.empty(numel, dtype=dtype, device=device)  # no pinning without CUDA

    monkeypatch.setattr(arena_module, "_empty", host_block)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    n, numel = 7, 3 * 1024 + 5  # fp16 slots of 6154 bytes: 43078 bytes, 65536 if rounded
    arena = CheckpointArena(n, pin_memory=True)
    views = [arena.take(numel, torch.float16, "cpu") for _ in range(n)]
    assert asked and all(pin and b & (b - 1) == 0 for b, pin in asked), asked
    assert arena.capacity_bytes == sum(b for b, _ in asked) < 65536
    spans = sorted((v.data_ptr(), v.data_ptr() + 2 * v.numel()) for v in views)
    assert all(v.numel() == numel for v in views)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    arena.reset()
    assert arena.take(numel, torch.float16, "cpu").data_ptr() == views[0].data_ptr()


def test_names_state_dict_and_eval():
    cfg = ModelConfig(**MODEL)
    ref = GPT(cfg, seed=2)
    model = copy.deepcopy(ref)
    handle = apply_activation_checkpointing(model, None, _zr(dict(partition_activations=True)))
    names = [n for n, _ in model.named_parameters()]
    assert "blocks.1.block.mlp.fc.weight" in names
    assert [canonical_name(n) for n in names] == [n for n, _ in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())  # keys stay stable
    model.load_state_dict(ref.state_dict())
    ref.load_state_dict(model.state_dict())
    idx, tgt = _batch(0, 0, cfg)
    with torch.no_grad():  # eval: nothing is saved, nothing is tracked
        assert torch.equal(model(idx, tgt)[1], ref(idx, tgt)[1])
    assert handle.tracker.n_live == 0
    handle.remove()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    with pytest.raises(ValueError, match="cpu_checkpointing"):
        apply_activation_checkpointing(ref, None, ZeroRConfig(activation_checkpointing=True,
                                                              cpu_checkpointing=True))


# odd TP degree (3), every stage, fp32 and bf16: all variants give the same parameters as no
# checkpointing at the same precision (recompute is deterministic, P_a's gather is exact)
ODD_MODEL = dict(n_layer=2, n_embd=48, n_head=3, seq_len=15, vocab_size=96, vocab_pad_multiple=8)


def _slow_worker(rank: int, world: int) -> dict:
    topo = Topology.build(tp=3)
    out = {}
    for dtype in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            runs = {name: _train_strategy(topo, stage, kw, ODD_MODEL, dtype)
                    for name, kw in VARIANTS.items()}
            out[(dtype, stage)] = {name: max(
                (r["params"][k].float() - runs["none"]["params"][k].float()).abs().max().item()
                for k in r["params"]) for name, r in runs.items()}
    return out


@pytest.mark.slow
def test_odd_tp_all_stages_fp32_bf16():
    for rank, res in enumerate(spawn(_slow_worker, 3, join_timeout_s=900)):
        for key, deltas in res.items():
            for name, delta in deltas.items():
                assert delta <= TOL, (rank, key, name, delta)


# ----------------------------------------------------------------------- Hydra (Table 3)
def _compose(overrides):
    register_configs()
    conf = str(ROOT / "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        return to_config(compose("config", overrides=overrides))


def test_table3_configs_compose():
    """conf/zero_r/c*.yaml equal the one definition, zero_repro.scale.paper.table3."""
    for name, row in TABLE3.items():
        cfg = validate(_compose([f"zero_r={name}"]))
        assert cfg.zero.stage == row.stage
        assert cfg.zero_r == zero_r_config(name)  # every field
        assert zero_overrides(name) == {"zero.stage": cfg.zero.stage, **{
            f"zero_r.{k}": v for k, v in dataclasses.asdict(cfg.zero_r).items()}}
    assert validate(_compose(["zero_r=off"])).zero_r == zero_r_config("off")
    assert [TABLE3[c].stage for c in ("c1", "c2", "c3", "c4", "c5")] == [1, 1, 2, 2, 2]
    cfg = _compose(["zero_r=c4"])
    assert cfg.zero.stage == 2 and cfg.zero_r.partition_activations
    cfg = _compose(["zero_r=c4", "zero.stage=3"])  # a later override wins
    assert cfg.zero.stage == 3 and cfg.zero_r.partition_activations
    cfg = _compose(["zero.stage=0", "zero_r=c2", "zero_r.contiguous_memory=false"])
    assert cfg.zero.stage == 0 and not cfg.zero_r.contiguous_memory
    assert cfg.zero_r.partition_activations and cfg.zero_r.constant_buffers
    off = _compose(["zero.stage=3", "zero_r=off"])
    assert off.zero.stage == 3 and not any(
        [off.zero_r.activation_checkpointing, off.zero_r.partition_activations,
         off.zero_r.cpu_checkpointing, off.zero_r.constant_buffers, off.zero_r.contiguous_memory])
    with pytest.raises(ValueError, match="cpu_checkpointing"):
        validate(_compose(["zero_r=c5", "zero_r.partition_activations=false"]))


# ----------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_and_fragmentation():
    cfg = ModelConfig(n_layer=4, n_embd=256, n_head=4, seq_len=256, vocab_size=512)
    ref = GPT(cfg, seed=4).cuda()
    idx, tgt = (t.cuda() for t in _batch(0, 0, cfg))
    _, loss = ref(idx, tgt)
    loss.backward()
    grads = [p.grad for p in ref.parameters()]
    frag = {}
    for name in ("ckpt", "pa_cpu", "md", "pa_cpu_md"):
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        handle = apply_activation_checkpointing(model, None, _zr(VARIANTS[name]))
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(idx, tgt)[1].backward()
        torch.cuda.synchronize()
        delta = max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), grads))
        assert delta <= 1e-5, (name, delta)
        mem = handle.memory()
        if "cpu" in name:
            assert mem["ckpt_device"] == 0 and mem["ckpt_cpu"] == 4 * 2 * 256 * 256 * 4
        if "md" in name:
            assert handle.arena.device.type == ("cpu" if "cpu" in name else "cuda")
        frag[name] = fragmentation_stats()
    for stats in frag.values():
        assert stats["reserved"] >= stats["allocated"] > 0
        assert stats["reserved_minus_allocated"] >= 0 and stats["largest_free_block"] >= 0

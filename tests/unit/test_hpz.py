"""ZeRO++'s hpZ (``zero.hpz``, stage 3) and the comm ledger's split by link, on gloo.

Ranks are told they sit ``per_node`` to a node (``Topology.build(ranks_per_node=...)``): at world
4 two simulated nodes of 2 ranks, at world 6 nodes of G. One spawn per world runs every case:

* fp32: the parameters after every step match the single-process AdamW reference within 1e-5
  (world 4, G = 2; world 6, G = 3 and G = 2, slow), with activation checkpointing too (its
  recompute gathers inside backward);
* bf16: hpZ changes where the backward gathers read, not the values: losses and parameters
  equal plain stage 3's bit for bit;
* the backward moves no all-gather bytes across nodes (the ledger read around
  ``strategy.backward``), the forward's gathers cross them; hpZ's all-gathers in total equal
  plain stage 3's (Ψ forward + Ψ - Ψ_kept backward, §7);
* the memory ledger's ``params_hpz`` is the secondary, 2Ψ/G bytes in bf16 (padding aside), on
  top of stage 3's 16Ψ/N_d;
* the ledger's inter-node and intra-node bytes equal an independent count of the collectives
  torch.distributed ran, per process group, sorted by whether the group's ranks span nodes
  (the native gloo transport: the shared-memory one moves bytes outside torch.distributed).
"""
from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch
import torch.distributed as tdist

from tests.unit.test_zero_equivalence import MICRO, Reference, batch, make, tp1_params
from zero_repro.runtime.comm.launch import spawn

TOL = 1e-5
STEPS = 3
# the §7 volume each torch.distributed collective moves, from its arguments: (factor, the
# tensor whose size counts); all_reduce counts twice, as the ledger does
# (torch 2.13 names the tensor forms ``*_single``; older ones ``*_into_tensor`` / ``*_tensor``)
C10D = {"all_reduce": (2, 0), "broadcast": (1, 0), "reduce": (1, 0),
        "all_gather_into_tensor": (1, 0), "all_gather_single": (1, 0),
        "reduce_scatter_tensor": (1, 1), "reduce_scatter_single": (1, 1)}


class C10dCount:
    """Counts the bytes of every torch.distributed collective per process group's ranks,
    wrapping the module's functions for the duration (a test's own instrument, independent of
    ``comm``'s ledger)."""

    def __init__(self):
        self.bytes: dict[tuple, int] = defaultdict(int)
        self.saved = {}

    def __enter__(self):
        for name, (factor, arg) in C10D.items():
            fn = getattr(tdist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapped(*a, _fn=fn, _factor=factor, _arg=arg, **kw):
                t, group = a[_arg], kw.get("group")
                ranks = tuple(tdist.get_process_group_ranks(group)) if group is not None \
                    else tuple(range(tdist.get_world_size()))
                self.bytes[ranks] += _factor * t.numel() * t.element_size()
                return _fn(*a, **kw)
            setattr(tdist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(tdist, name, fn)

    def by_link(self, per_node: int) -> dict[str, int]:
        out = {"intra_node": 0, "inter_node": 0}
        for ranks, n in self.bytes.items():
            out["inter_node" if len({r // per_node for r in ranks}) > 1 else "intra_node"] += n
        return out


def run_case(c: dict, rank: int) -> dict:
    """Train ``STEPS`` steps; per step the ledger of the backward alone, of the whole step and
    (``c["count"]``) the independent c10d count; rank 0: the reference's distance."""
    native = c.get("count")
    old = os.environ.get("ZR_CPU_TRANSPORT")
    if native:
        os.environ["ZR_CPU_TRANSPORT"] = "native"
    try:
        topo, model, strat, train = make(c)
    finally:
        if native:
            os.environ.pop("ZR_CPU_TRANSPORT")
            if old is not None:
                os.environ["ZR_CPU_TRANSPORT"] = old
    ref = Reference(train, 1.0) if rank == 0 and c.get("compare") else None
    out = {"diff": [], "losses": [], "steps": [], "params": None,
           "psi": sum(p.numel() for p in model.parameters())}
    for step in range(STEPS):
        idx, tgt = batch(step, topo.dp * MICRO)
        r0 = topo.dp_rank * MICRO
        topo.ledger.reset()
        counter = C10dCount() if native else None
        with counter or _nothing():
            _, loss = strat(idx[r0:r0 + MICRO], tgt[r0:r0 + MICRO])
            before = topo.ledger.link_bytes()
            ag_before = _gathers(topo.ledger)
            strat.backward(loss)
            after = topo.ledger.link_bytes()
            ag_after = _gathers(topo.ledger)
            strat.step()
        strat.zero_grad()
        out["losses"].append(loss.item())
        out["steps"].append({
            "backward_gathers": {k: ag_after[k] - ag_before.get(k, 0) for k in ag_after},
            "gathers": ag_after, "link": topo.ledger.link_bytes(),
            "backward_link": {k: after[k] - before[k] for k in after},
            "inter_groups": sorted(topo.ledger.inter_node),
            "c10d": counter.by_link(c["per_node"]) if counter else None})
        full = tp1_params(strat)
        if ref is not None:
            ref.step(idx, tgt)
            out["diff"].append(max((full[n] - p.detach()).abs().max().item()
                                   for n, p in ref.model.named_parameters()))
        if rank == 0 and step == STEPS - 1:
            out["params"] = full
    out["memory"] = strat.memory_ledger().as_dict()
    strat.remove_hooks()
    return out


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _gathers(ledger) -> dict[str, int]:
    """All-gather volume (elements) per group name."""
    return {k.split("/")[1]: v["volume"] for k, v in ledger.as_dict().items()
            if k.startswith("all_gather/")}


def worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    torch.manual_seed(0)
    return [run_case(c, rank) for c in cases]


def cases_for(world: int) -> list[dict]:
    if world == 4:
        g = 2
        base = {"stage": 3, "per_node": g}
        return [dict(base, hpz=True, shard_size=g, compare=True),
                dict(base, hpz=True, compare=True,  # shard_size "all" + hpz: G = the node's
                     zero_r={"activation_checkpointing": True, "constant_buffers": True,
                             "contiguous_memory": True}),
                dict(base, hpz=True, shard_size=g, dtype="bf16"),
                dict(base, dtype="bf16"),
                dict(base, hpz=True, shard_size=g, count=True),
                dict(base, count=True)]
    return [{"stage": 3, "per_node": g, "hpz": True, "shard_size": g, "compare": True}
            for g in (3, 2)]


@pytest.fixture(scope="module")
def by_world():
    cache: dict[int, list] = {}

    def get(world: int) -> list:
        if world not in cache:
            cache[world] = spawn(worker, world, cases_for(world), timeout_s=300)
        return cache[world]

    return get


WORLDS = [4, pytest.param(6, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world", WORLDS)
def test_hpz_matches_one_process(by_world, world):
    for c, r in zip(cases_for(world), by_world(world)[0]):
        if c.get("compare"):
            assert len(r["diff"]) == STEPS and max(r["diff"]) <= TOL, (c, r["diff"])


@pytest.mark.parametrize("world", WORLDS)
def test_hpz_backward_gathers_stay_inside_the_node(by_world, world):
    """Every backward all-gather runs on the node's shard group, none across nodes; the
    forward's do cross (they read the primary, partitioned over every node)."""
    for rank_res in by_world(world):
        for c, r in zip(cases_for(world), rank_res):
            if not c.get("hpz"):
                continue
            for s in r["steps"]:
                assert "dp_shard" not in s["inter_groups"] and "dp" in s["inter_groups"], s
                back = s["backward_gathers"]
                assert back.get("dp_shard", 0) > 0 and back.get("dp", 0) == 0, (c, back)
                assert s["gathers"]["dp"] > 0, (c, s["gathers"])


def test_hpz_moves_plain_stage3_volume_with_less_across_nodes(by_world):
    """Same §7 all-gather volume as plain stage 3, the backward's share moved inside the
    node: the inter-node bytes fall by exactly the intra-node gathers' bytes."""
    res = by_world(4)[0]
    cases = cases_for(4)
    hpz, plain = res[4], res[5]  # the counted pair: same transport, fp32
    assert cases[4].get("hpz") and not cases[5].get("hpz")
    for h, p in zip(hpz["steps"], plain["steps"]):
        assert sum(h["gathers"].values()) == sum(p["gathers"].values()), (h, p)
        moved = h["gathers"]["dp_shard"] * 4  # fp32 bytes
        assert h["link"]["intra_node"] == moved > 0, (h["link"], moved)
        assert p["link"]["inter_node"] - h["link"]["inter_node"] == moved, (h, p)
        assert p["backward_link"]["intra_node"] == 0


def test_hpz_bf16_is_plain_stage3_bit_for_bit(by_world):
    res = by_world(4)[0]
    hpz, plain = res[2], res[3]
    assert hpz["losses"] == plain["losses"]
    for name, t in plain["params"].items():
        assert torch.equal(hpz["params"][name], t), name


def test_hpz_secondary_in_the_memory_ledger(by_world):
    """params_hpz = 2Ψ/G (bf16) and stage 3's own shards stay 2Ψ/N_d (padding < 1%)."""
    for rank_res in by_world(4):
        mem, psi = rank_res[2]["memory"], rank_res[2]["psi"]
        assert 1.0 <= mem["params_hpz"] / (2 * psi / 2) <= 1.01, mem
        assert 1.0 <= mem["params_lp"] / (2 * psi / 4) <= 1.01, mem
        assert "params_hpz" not in rank_res[3]["memory"]


def test_link_bytes_equal_an_independent_c10d_count(by_world):
    """World 4, two simulated nodes of 2: the ledger's bytes per link equal the bytes the
    wrapped torch.distributed collectives moved on groups inside / across nodes."""
    for rank_res in by_world(4):
        for c, r in zip(cases_for(4), rank_res):
            if not c.get("count"):
                continue
            for s in r["steps"]:
                assert s["c10d"] == s["link"], (c, s)
                assert s["link"]["inter_node"] > 0


# ------------------------------------------------------------------ config (no spawn)
def test_hpz_config_is_checked_and_node_is_decided_once():
    from zero_repro.config import Config
    from zero_repro.validation import ranks_per_node, shard_size_of, validate
    cfg = Config()
    cfg.parallel.world_size = 8
    cfg.cluster.gpus_per_node = 4
    cfg.zero.stage, cfg.zero.hpz = 2, True
    with pytest.raises(ValueError, match="use zero.stage=3 or drop zero.hpz"):
        validate(cfg)
    cfg.zero.stage = 3
    cfg.zero.offload_optimizer = "cpu"
    with pytest.raises(ValueError, match="drop zero.hpz"):
        validate(cfg)
    cfg.zero.offload_optimizer = "none"
    validate(cfg)
    # the local launcher starts every rank on this host: "node" is the world there; srun and
    # torchrun start gpus_per_node per node, as a simulated run of the cluster assumes
    cfg.launcher.name = "local"
    assert ranks_per_node(cfg) == 8 and ranks_per_node(cfg, launched=False) == 4
    cfg.launcher.name = "slurm"
    assert ranks_per_node(cfg) == 4
    assert shard_size_of("all", 8, 4, hpz=True) == 4 == shard_size_of("node", 8, 4)

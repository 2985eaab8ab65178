"""Which shard size G, and whether hpZ, on this cluster's links: the estimate's recommendation for
hierarchical sharding (FSDP2's HSDP, MiCS, ZeRO++'s hpZ; the collectives: ``scale.hsdp``).

For each ZeRO stage the estimate ran (1-3) and each candidate -- G = N_d (plain ZeRO), G = k
(a node's DP ranks), the powers of two times k between them, and at stage 3 hpZ with its
secondary shard over k -- the per-rank memory and the step time at the requested micro-batch:

  * memory: the stage's dry run (at the estimate's own G) with its model states moved to the
    candidate's Table 1 (``model_state_bytes`` at Ψ_padded, which the dry run's ledger equals
    exactly); gathered units, buffers, activations and the allocator's extra as the dry run
    found them. It fits when within the capacity that dry run was judged at;
  * time: the modern step model with the candidate's mesh (``modern_step`` via ``scale.hsdp``).

The best: the fastest that fits; a choice within ``TIME_TIE`` of it that holds less memory wins
instead (a smaller difference is below what the time model resolves: it leaves out launch gaps,
stragglers and the compute slowed by concurrent communication).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zero_repro import config as C
from zero_repro.runtime.model import flops
from zero_repro.scale import estimate_time as T
from zero_repro.scale.hardware import Hardware
from zero_repro.scale.paper.table1 import model_state_bytes

GB = 1e9
TIME_TIE = 0.01  # relative step-time difference below the model's resolution (module doc)


@dataclass(frozen=True)
class Choice:
    """One candidate: stage, G, hpZ, per-rank memory (peak reserved, bytes) and its verdict,
    the step (s), its exposed DP communication (s), DP bytes per rank and step inside a node
    and between nodes, tokens/s per GPU; ``measured``: the memory is the dry run's own (the
    estimate's configuration), not moved by Table 1."""
    stage: int
    shard_size: int
    hpz: bool
    label: str
    memory: float
    fits: bool
    step_s: float
    dp_exposed_s: float
    intra_bytes: float
    inter_bytes: float
    tokens_per_s_gpu: float
    measured: bool = False
    slowdown_s: float = 0.0  # the compute slowed by the collectives it hides (modern_step)


def candidates(stage: int, n_d: int, per_node: int) -> list[tuple[int, bool]]:
    """(G, hpZ) to compare at ``stage`` (module doc); plain ZeRO first."""
    out = [(n_d, False)]
    if 1 < per_node < n_d and n_d % per_node == 0:
        g = per_node
        while g < n_d:
            if n_d % g == 0:
                out.append((g, False))
            g *= 2
        if stage == 3:
            out.append((n_d, True))
    return out


def label(g: int, hpz: bool, n_d: int, per_node: int) -> str:
    if hpz:
        return f"hpZ (secondary over {per_node})"
    return f"G = {g}" + (" (all)" if g == n_d else " (node)" if g == per_node else "")


def _states(s, g: int, hpz: bool, per_node: int, lp: int) -> float:
    return model_state_bytes(s.psi_padded, s.stage, s.n_d, lp_bytes=lp, shard_size=g,
                             hpz_size=per_node if hpz else None)


def choices(stages: list, cfgs: dict, hw, params, timing, zero_r: str, per_node: int,
            lp: int = 2) -> list[Choice]:
    """Every candidate of every stage >= 1 of ``stages`` (``StageEstimate``s, their configs in
    ``cfgs``) with its memory and step time (module doc)."""
    out = []
    for s in sorted(stages, key=lambda x: x.stage):
        if s.stage == 0 or not s.perf:
            continue
        base = _states(s, s.shard_size, s.hpz, per_node, lp)
        for g, hpz in candidates(s.stage, s.n_d, per_node):
            same = (g, hpz) == (s.shard_size, s.hpz)
            mem = s.peak_reserved + (0.0 if same else _states(s, g, hpz, per_node, lp) - base)
            cfg = cfgs[s.stage]
            cfg = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero,
                                                                    shard_size=str(g)))
            p = T.performance(cfg, hw, params, timing, zero_r, hpz=hpz)
            out.append(Choice(s.stage, g, hpz, label(g, hpz, s.n_d, per_node), mem,
                              s.fits if same else mem <= s.capacity, p["step_s"], p["dp_s"],
                              p["dp_intra_bytes"], p["dp_inter_bytes"],
                              p.get("tokens_per_s_gpu", p["tokens_per_s"] / cfg.parallel.
                                    world_size), same,
                              p.get("terms", {}).get("overlap_slowdown", 0.0)))
    return out


def best(chs: list[Choice], inter_gbps: float) -> tuple[Choice | None, str]:
    """The best choice and a one-line reason (module doc)."""
    ok = [c for c in chs if c.fits]
    if not ok:
        return None, "no shard size fits: raise TP, add GPUs or offload"
    fastest = min(ok, key=lambda c: c.step_s)
    near = [c for c in ok if c.step_s <= fastest.step_s * (1 + TIME_TIE)]
    pick = min(near, key=lambda c: (c.memory, c.step_s))
    plain = next((c for c in chs if c.stage == pick.stage and not c.hpz
                  and c.shard_size == max(x.shard_size for x in chs)), None)
    return pick, _reason(pick, plain, fastest, chs, inter_gbps)


def _reason(pick: Choice, plain: Choice | None, fastest: Choice, chs: list[Choice],
            gbps: float) -> str:
    at = f"at {gbps:g} Gbit/s per node"
    if plain is None or pick is plain:
        others = [c for c in chs if c.stage == pick.stage and c is not pick]
        quick = min(others, key=lambda c: c.step_s, default=None)
        why = (f"{pick.label} at stage {pick.stage}: {at} its DP collectives are exposed "
               f"{pick.dp_exposed_s:.2f} s of a {pick.step_s:.2f} s step")
        if quick is None:
            return why
        if quick.step_s < pick.step_s and quick is fastest:
            return (why + f"; {quick.label} cuts the inter-node bytes per rank from "
                    f"{pick.inter_bytes / GB:.1f} to {quick.inter_bytes / GB:.1f} GB but the "
                    f"exposed time only to {quick.dp_exposed_s:.2f} s, "
                    f"{1 - quick.step_s / pick.step_s:.1%} of the step (below the model's "
                    f"{TIME_TIE:.0%} resolution), for {(quick.memory - pick.memory) / GB:.1f} "
                    f"GB more per rank")
        return (why + f"; a smaller G or hpZ holds more per rank and is not faster "
                f"(the fastest other, {quick.label}: {quick.step_s:.2f} s)")
    kind = ("stage 3's backward all-gather stays inside the node (NVLink)" if pick.hpz else
            "the shard group's collectives stay inside the node (NVLink)"
            if pick.inter_bytes < plain.inter_bytes else "it needs fewer ranks per collective")
    fit = "" if plain.fits else " (G = all does not fit)"
    return (f"{pick.label} at stage {pick.stage}: {kind}; {at} the inter-node bytes per rank "
            f"fall from {plain.inter_bytes / GB:.1f} to {pick.inter_bytes / GB:.1f} GB and the "
            f"exposed DP communication from {plain.dp_exposed_s:.2f} to "
            f"{pick.dp_exposed_s:.2f} s{_slower(plain, pick)} (step {plain.step_s:.2f} -> "
            f"{pick.step_s:.2f} s) for {(pick.memory - plain.memory) / GB:+.1f} GB per "
            f"rank{fit}")


def _slower(plain: Choice, pick: Choice) -> str:
    """The change in the compute's slowdown under hidden collectives, where it moves the
    step by more than the exposed time does."""
    d = plain.slowdown_s - pick.slowdown_s
    if abs(d) <= abs(plain.dp_exposed_s - pick.dp_exposed_s):
        return ""
    return (f", and the compute slowed by the collectives it hides from "
            f"{plain.slowdown_s:.2f} to {pick.slowdown_s:.2f} s (fewer bytes hidden behind it)")


def hpz_size(est) -> int:
    """k of an estimate: its DP ranks of one TP rank on a node."""
    return max(1, min(est.world_size // est.tp, est.cluster["gpus_per_node"] // est.tp))


def per_node(cfg: C.Config) -> int:
    """k: the DP ranks of one TP rank on a node (hpZ's secondary group)."""
    p = cfg.parallel
    return max(1, min(p.world_size // p.tp, cfg.cluster.gpus_per_node // p.tp))


def hpz_bytes(cfg: C.Config) -> int:
    """hpZ's secondary lp shard per rank, 2Ψ/k (``table1.model_state_bytes``' hpZ term);
    ValueError where there is no second node to save traffic to."""
    p, k = cfg.parallel, per_node(cfg)
    if not 1 < k < p.world_size // p.tp or (p.world_size // p.tp) % k:
        raise ValueError(f"hpZ keeps a secondary shard over a node's {k} DP ranks: it needs "
                         f"more than one node of several DP ranks (DP {p.world_size // p.tp})")
    lp = 4 if cfg.zero.dtype == "fp32" else 2
    return int(lp * flops.param_count(cfg.model, p.tp) / p.tp / k)


def for_estimate(out: list, cfgs: dict, hw: Hardware, params, timing: T.Timing, zr: str,
               base: C.Config) -> tuple[list, tuple]:
    """``shard_choice``'s candidates and best on the modern time model (none otherwise)."""
    if not any(s.perf.get("model") == "modern" for s in out) or any(
            s.offload != "none" for s in out):
        return [], (None, "")
    lp = 4 if base.zero.dtype == "fp32" else 2
    chs = choices(out, cfgs, hw, params, timing, zr, per_node(base), lp)
    return chs, best(chs, base.cluster.inter_node_gbps) if chs else (None, "")

"""The estimate's report of hierarchical sharding (``python -m zero_repro.lab.estimate
--shard-size all|node|G --hpz``): the header's words, the DP traffic inside a node and between
nodes, and the shard-size table with the best choice marked and why (the numbers:
``zero_repro.scale.shard_choice``, ``scale.hsdp``). GB = 1e9 bytes.
"""
from __future__ import annotations

import dataclasses

from zero_repro import config as C
from zero_repro import validation
from zero_repro.scale import estimate as E

GB = 1e9


def shard_label(est: E.Estimate, st: list) -> str:
    """The header's words for hierarchical sharding ('' for plain ZeRO)."""
    g = {s.shard_size for s in st if s.stage}
    out = ""
    if g and g != {est.world_size // est.tp}:
        out += f"; stages 1-3 sharded over G = {g.pop()} (zero.shard_size={est.shard_size})"
    if est.hpz:
        out += "; stage 3 with hpZ (its secondary shard: Table 1's closed form)"
    return out


def hierarchy_lines(est: E.Estimate) -> list[str]:
    """Each shard size and hpZ on these links, the best marked, and why
    (``scale.shard_choice``)."""
    if not est.choices:
        return []
    c = est.cluster
    lines = ["", f"Shard size on these links ({c['inter_node_gbps']:g} Gbit/s per node, "
             f"{c['intra_node_gbps']:g} GB/s in a node; simulated: memory = each stage's dry "
             f"run with Table 1's model states for G, time = the modern step model)",
             f"  {'stage, shard size':<34}{'memory GB':>10}{'verdict':>9}{'step s':>9}"
             f"{'DP exp. s':>10}{'inter GB':>10}{'intra GB':>10}{'tok/s/GPU':>10}"]
    best, why = est.hierarchy
    none = sorted({c.stage for c in est.choices} - {c.stage for c in est.choices if c.fits})
    for ch in (c for c in est.choices if c.stage not in none):
        lines.append(f"  {f'stage {ch.stage}, {ch.label}':<34}{ch.memory / GB:>10.1f}"
                     f"{'fits' if ch.fits else 'OOM':>9}{ch.step_s:>9.2f}"
                     f"{ch.dp_exposed_s:>10.2f}{ch.inter_bytes / GB:>10.1f}"
                     f"{ch.intra_bytes / GB:>10.1f}{ch.tokens_per_s_gpu:>10,.0f}"
                     + ("  <- best" if ch is best else ""))
    if none:
        lines.append(f"  (stage{'s' if len(none) > 1 else ''} "
                     f"{', '.join(map(str, none))}: no shard size fits)")
    lines.append("Shard size: " + (f"stage {best.stage}, {best.label}" if best else "none")
                 + f" -- {why}.")
    return lines


def shard_size_arg(args, cfg: C.Config) -> str:
    """``--shard-size`` validated against the layout (G must divide N_d); with ``--hpz`` it
    applies to stages 1-2 (hpZ's primary partition is over every DP rank)."""
    z = dataclasses.replace(cfg.zero, stage=3, shard_size=args.shard_size.strip())
    validation.validate(dataclasses.replace(cfg, zero=z))
    if args.hpz:
        E.hpz_bytes(cfg)  # a second node of several DP ranks, or the fix
    if (args.shard_size != "all" or args.hpz) and args.time_model != "modern":
        raise ValueError("--shard-size and --hpz are timed by the modern time model only: "
                         "drop --time-model paper2020")
    return z.shard_size

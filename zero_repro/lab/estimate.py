"""``python -m zero_repro.lab.estimate``: will it fit, which stage, how fast -- the command a
practitioner runs before training (the numbers: ``zero_repro.scale.estimate``; this module
reads the command line, builds the config, prints the report and puts DeepSpeed's own
model-state estimator beside it where DeepSpeed is installed).

    python -m zero_repro.lab.estimate --model llama2_7b --gpus 8 --gpus-per-node 4 \\
        --gpu l40s --intra-gbps 64 --inter-gbps 100 --batch 1
    python -m zero_repro.lab.estimate --model llama2_70b --cluster h100 --gpus 64 --tp 8
    python -m zero_repro.lab.estimate --shape layers=32,hidden=4096,heads=32,kv_heads=8,\\
        ffn=14336,vocab=128256,seq=8192 --cluster h100 --gpus 8 --ac selective
    ... --time-model paper2020    (the 2020 stack: the paper's Fig 2-calibrated V100 model,
                                   the 2019 Megatron layer's activations in the dry run)
    ... --collectives ring | --no-overlap-slowdown   (the time model's switches, off)
    ... --shard-size node --hpz    (hierarchical sharding: stages 1-3 over a node's ranks;
                                    stage 3 with ZeRO++'s hpZ)

Time: today's stack on the cluster's GPU (``--gpu KEY`` names it; without ``--cluster`` the GPU's
datasheet facts make a custom cluster;
``--ac none|selective|full``, ``--attention flash|unfused``), with a band; the text shows the
three largest terms of the step, ``--json`` every term.

Bad input: one ``error:`` line, exit status 2, before anything runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys

from zero_repro import config as C
from zero_repro import gpus
from zero_repro import schema
from zero_repro import validation
from zero_repro.lab import estimate_shard as SH
from zero_repro.lab import memory_view
from zero_repro.lab.estimate_deepspeed import deepspeed_figures, largest_layer  # noqa: F401
from zero_repro.scale import era, limit, shard_choice
from zero_repro.scale import estimate as E
from zero_repro.scale import estimate_time as T
from zero_repro.scale import offload_time as OT
from zero_repro.scale.paper.clusters import list_clusters, load_cluster

GB = 1e9
STAGE_NAMES = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
SHAPE_KEYS = {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head",
              "kv_heads": "n_kv_head", "ffn": "ffn_hidden", "vocab": "vocab_size",
              "seq": "seq_len", "family": "family", "theta": "rope_theta"}


# ------------------------------------------------------------------------------ inputs
def parse_bytes(text: str) -> float:
    """'48GB' (1e9), '48GiB' (2^30), '48' (GB) -> GB (1e9 bytes), the cluster schema's unit."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(gib|gb|g)?\s*", text.lower())
    if not m:
        raise ValueError(f"--device-memory {text!r}: give a size like 48GB or 80GiB")
    value = float(m.group(1))
    return value * 2**30 / GB if m.group(2) == "gib" else value


def model_from_args(args) -> C.ModelConfig:
    """The model by name (conf/model) or by shape (``--shape k=v,...``: a Llama unless
    family=gpt), with ``--seq`` on top."""
    if args.model and args.shape:
        raise ValueError("give --model NAME or --shape k=v,..., not both")
    if args.model:
        m = C.ModelConfig(**schema.model_conf(args.model))
    elif args.shape:
        fields: dict = {"family": "llama", "bias": False, "name": "shape"}
        for item in args.shape.split(","):
            k, _, v = item.partition("=")
            if k.strip() not in SHAPE_KEYS or not v:
                raise ValueError(f"--shape {item!r}: use key=value with keys "
                                 f"{sorted(SHAPE_KEYS)}")
            key = SHAPE_KEYS[k.strip()]
            fields[key] = v.strip() if key == "family" else float(v) if key == "rope_theta" \
                else int(v)
        if fields["family"] == "gpt":
            fields["bias"] = True
        m = C.ModelConfig(**fields)
    else:
        raise ValueError("give the model: --model NAME (conf/model) or --shape k=v,...")
    if args.seq:
        m = dataclasses.replace(m, seq_len=args.seq)
    return m


def cluster_from_args(args) -> C.ClusterConfig:
    """A cluster by name (conf/cluster), or of a GPU kind (``--gpu``: its datasheet facts from
    ``zero_repro.gpus``) or by device memory, with links; either with flags on top."""
    if args.cluster:
        if args.cluster not in list_clusters():
            raise ValueError(f"--cluster {args.cluster!r}: choose one of {list_clusters()}")
        c = load_cluster(args.cluster)
    elif args.device_memory or args.gpu:
        c = C.ClusterConfig(name="custom", device="cuda", backend="nccl",
                            gpus_per_node=args.gpus_per_node or args.gpus, gpu=args.gpu or "",
                            description="given on the command line")
    else:
        raise ValueError("give the cluster: --cluster NAME (conf/cluster), --gpu KEY "
                         "(zero_repro/gpus) or --device-memory 48GB [--gpus-per-node N "
                         "--peak-tflops T --intra-gbps GB/s --inter-gbps Gbit/s]")
    over = {"device_memory_gb": parse_bytes(args.device_memory) if args.device_memory else None,
            "gpus_per_node": args.gpus_per_node, "peak_tflops": args.peak_tflops,
            "intra_node_gbps": args.intra_gbps, "inter_node_gbps": args.inter_gbps,
            "pcie_gbps": args.pcie_gbps}
    c = dataclasses.replace(c, device="cuda", backend="nccl",
                            **{k: v for k, v in over.items() if v is not None})
    if c.device_memory_gb <= 0:
        raise ValueError(f"cluster {c.name!r} has no device memory: add --device-memory")
    return c


def config_from_args(args) -> C.Config:
    m = model_from_args(args)
    cfg = C.Config(model=m, parallel=C.ParallelConfig(world_size=args.gpus, tp=args.tp),
                   cluster=cluster_from_args(args))
    bucket = args.bucket or E.BUCKET
    cfg.zero = dataclasses.replace(cfg.zero, dtype=args.dtype, reduce_bucket_size=bucket,
                                   allgather_bucket_size=bucket)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=args.batch)
    return validation.validate(cfg)


# ------------------------------------------------------------------------------ report
def _row(label: str, values, fmt="{:>10.2f}", width=42) -> str:
    cells = [("{:>10}".format(v) if isinstance(v, str) else fmt.format(v)) for v in values]
    return f"  {label:<{width}}" + "".join(cells)


def report(est: E.Estimate, ds: dict | None = None) -> str:
    """The estimate as text: model states against Table 1 (and DeepSpeed's estimator), the
    per-rank picture per stage, the verdicts, the largest micro-batch, time, traffic and the
    recommendation. GB = 1e9 bytes throughout."""
    m, c = est.model, est.cluster
    st = sorted(est.stages, key=lambda s: s.stage)
    stages = [s.stage for s in st]
    n_d = est.world_size // est.tp
    shape = (f"{m['n_layer']} x {m['hidden']}, {m['heads']} heads / {m['kv_heads']} kv, "
             f"ffn {m['ffn']}, vocab {m['vocab']}" if m["family"] == "llama"
             else f"{m['n_layer']} x {m['hidden']}, {m['heads']} heads, vocab {m['vocab']}")
    nodes = max(1, est.world_size // max(1, c["gpus_per_node"]))
    lines = [
        era.describe(est.stack, model_family=m["family"]),
        f"Will it fit: {m['name']} ({m['family']}: {shape}; Ψ = {m['params'] / 1e9:.2f}B"
        + (f", nominal {m['nominal']}" if m["nominal"] else "") + ")",
        f"  on {est.world_size} GPUs ({nodes} node{'s' if nodes > 1 else ''} x "
        f"{min(est.world_size, c['gpus_per_node'])}) of {c['device_bytes'] / GB:.1f} GB "
        f"({c['name']}), {c['peak_tflops']:g} TFLOP/s, links: {c['intra_node_gbps']:g} GB/s "
        f"in a node, {c['inter_node_gbps']:g} Gbit/s per node between nodes",
        f"  TP {est.tp} x DP {n_d}; micro-batch {est.batch} x {est.seq} tokens per GPU; "
        f"{est.dtype} parameters + fp32 master and Adam (K = 12)"
        + {"none": "", "cpu": " on the host (ZeRO-Offload, zero.offload_optimizer=cpu)",
           "param": "; stage 3's parameter shard on the host (zero.offload_param=cpu)",
           "cpu+param": " on the host, and stage 3's parameter shard too (ZeRO-Offload, "
                        "zero.offload_optimizer=cpu, zero.offload_param=cpu)"}[est.offload]
        + f"; ZeRO-R: {_ZR_LABEL[est.zero_r]}; DeepSpeed's bucket sizes (5e8)"
        + SH.shard_label(est, st),
        "",
        "Model states per GPU (GB)" + " " * 19 + "".join(f"{STAGE_NAMES[s]:>10}" for s in
                                                        stages)]
    nominal = _nominal(m["nominal"])
    if nominal:
        g = min((s.shard_size for s in st if s.stage and not s.hpz), default=n_d) or n_d
        cf = E.closed_form(nominal / est.tp, n_d, est.offload, g,
                           shard_choice.hpz_size(est) if est.hpz else None)
        lines.append(_row(f"Table 1, nominal Ψ = {m['nominal']}", [cf[s] / GB for s in stages]))
    lines.append(_row(f"Table 1, this shape Ψ = {m['params'] / 1e9:.2f}B"
                      + (f" / TP {est.tp}" if est.tp > 1 else ""),
                      [s.table1 / GB for s in st]))
    lines.append(_row("dry run's ledger (this runtime)", [s.model_states / GB for s in st]))
    off = est.offload != "none"
    if ds:
        lines.append(_row(f"DeepSpeed {ds['version']} estimator ("
                          + ("cpu_offload)" if off else "no offload)"),
                          [ds[s.stage] / GB if s.stage in (2, 3) else "-" for s in st]))
    if off:
        lines.append(_row("  on the host: Table 1's offload column", [s.table1_host / GB
                                                                      for s in st]))
        lines.append(_row("  on the host: the dry run's ledger", [s.host_bytes / GB
                                                                 for s in st]))
        if ds and ds.get("host"):
            per_node = max(1, min(est.world_size, c["gpus_per_node"]))
            lines.append(_row(f"  on the host: DeepSpeed (per node / {per_node})",
                              [ds["host"][s.stage] / per_node / GB if s.stage in (2, 3)
                               else "-" for s in st]))
    lines += ["", f"Per rank at micro-batch {est.batch} (dry run; GB)" + " " * 9
              + "".join(f"{'stage ' + str(s):>10}" for s in stages)]
    for part, label in (("model_states", "model states (own shards)"),
                        ("gathered_params", "gathered parameters (stage 3)"),
                        ("buffers", "buffers (C_B buckets, gather)"),
                        ("activations", "activations (ckpt + working + logits)"),
                        ("other", "other (step transients)")):
        lines.append(_row(label, [s.parts[part] / GB for s in st]))
    if any(s.stage == 3 for s in st):
        lines.append(_row("  (stage 3, the runtime's own gathered peak)",
                          [s.gathered_ledger / GB if s.stage == 3 else "-" for s in st]))
    lines.append(_row("= live peak", [s.live_peak / GB for s in st]))
    lines.append(_row("+ allocator's extra (rounding, fragments)",
                      [s.allocator_extra / GB for s in st]))
    lines.append(_row("= peak reserved (caching allocator)", [s.peak_reserved / GB for s in st]))
    cap = st[0].capacity / GB
    lines.append(_row("live peak while building", [s.build_live_peak / GB for s in st]))
    lines.append(_row("  build: peak reserved (judged)",
                      [s.build_peak_reserved / GB for s in st]))
    out = (st[0].device_capacity - st[0].capacity) / GB if st[0].device_capacity else 0.0
    lines.append(_row(f"verdict at {cap:.1f} GB" + (f" ({cap + out:.1f} less {out:.1f} outside)"
                                                   if out > 0 else "") + ", build and steps",
                      ["fits" if s.device_fits else "OOM" + ("" if s.build_fits else " build")
                       for s in st]))
    if any(s.limit for s in st):
        lines.append(_row("  with its band (limit+/-: at the limit)",
                          [limit.label(s.limit) if s.limit else "-" for s in st]))
        lines.append(_row("  band: need on the device (GB)",
                          [f"{s.limit['need_low'] / GB:.1f}-{s.limit['need_high'] / GB:.1f}"
                           if s.limit else "-" for s in st]))
    if off or any(s.host_bytes for s in st):
        hcap = st[0].host_capacity
        lines.append(_row("host memory per rank (GB)", [s.host_bytes / GB for s in st]))
        lines.append(_row(f"host verdict at {hcap / GB:.1f} GB per rank" if hcap else
                          "host verdict (cluster states no host RAM)",
                          [("fits" if s.host_fits else "OOM") if hcap else "-" for s in st]))
    lines.append(_row("largest micro-batch that fits", [str(s.max_batch) for s in st]))
    if any(s.perf for s in st):
        lines += [""] + (_time_modern(est, st) if st[0].perf.get("model") == "modern"
                         else _time_paper2020(est, st))
    stage, why = est.recommendation
    lines += ["", "Recommendation: " + (f"stage {stage} ({STAGE_NAMES[stage]})" if stage is
                                         not None else "none") + f" -- {why}."]
    lines += SH.hierarchy_lines(est)
    if ds:
        for s in st:
            if s.stage in (2, 3):
                lines.append(f"  DeepSpeed's estimator, stage {s.stage}: {ds[s.stage] / GB:.2f}"
                             f" GB (model states only); the dry run's peak reserved "
                             f"{s.peak_reserved / GB:.2f} GB adds activations "
                             f"{s.parts['activations'] / GB:.2f}, buffers "
                             f"{s.parts['buffers'] / GB:.2f}, gathered parameters "
                             f"{s.parts['gathered_params'] / GB:.2f} and the allocator's "
                             f"{s.allocator_extra / GB:.2f} GB")
    if est.outside:
        o = est.outside
        lines.append(f"  Outside the caching allocator (modern stack, per GPU): {o['mid'] / GB:.2f}"
                     f" GB taken off the device, the middle of {o['low'] / GB:.2f}-"
                     f"{o['high'] / GB:.2f} GB ({', '.join(o['parts'])}; "
                     f"scale/outside_modern.py)")
    if off and st[0].perf.get("model") == "modern":
        hc = est.cluster
        lanes, ghz = hc.get("host_lanes", 0), hc.get("host_ghz", [0, 0])
        core = (f"this machine's core streaming from DRAM, {OT.HOST_ADAM_SOURCE}" if not lanes
                else f"the cluster's: {lanes:g} fp32 lanes x {ghz[0]:g}-{ghz[1]:g} GHz against this "
                     f"machine's {OT.HERE_LANES} x {OT.HERE_CLOCK[0] / 1e9:g}-"
                     f"{OT.HERE_CLOCK[1] / 1e9:g} GHz in-cache rate, scale/offload_time.py")
        cores = hc['host_cores'] * hc.get('host_core_rate', OT.HOST_ADAM_PER_CORE['mid'])
        dram = OT.DRAM_EFFICIENCY['mid'] * hc['host_memory_gbps'] * GB / OT.HOST_BYTES
        lines.append(f"  Host step (ZeRO-Offload): {st[0].perf['host_rate'] / 1e9:.2f} G "
                     f"elements/s per rank = min({hc['host_cores']:g} cores x "
                     f"{hc.get('host_core_rate', 0) / 1e9:.2f} G/s per core = "
                     f"{cores / 1e9:.1f}, {OT.DRAM_EFFICIENCY['mid']:.0%} of "
                     f"{hc['host_memory_gbps']:.1f} GB/s DRAM / {OT.HOST_BYTES:.0f} B per "
                     f"element = {dram / 1e9:.2f}: {'the cores' if cores < dram else 'DRAM'} "
                     f"bind); per core from {core}; host per rank {hc['host_bytes'] / GB:.1f} "
                     f"GB (conf/cluster/{hc['name']}.yaml, a node's host over the ranks on it)")
    if est.zero_r == "selective":
        lines.append(f"  Selective checkpointing (every {est.timing['every']} blocks): memory "
                     f"interpolated between dry runs with every block and with no block "
                     f"checkpointed")
    judged = sum(s.seconds.get("search_judgements", 0) for s in st)
    cpu = est.cpu or {}
    lines.append(f"  ({len(st)} stages, {judged} batch judgements; largest micro-batch: "
                 f"{st[0].max_batch_method}; {est.seconds:.1f} s wall with {est.workers} "
                 f"worker{'s' if est.workers != 1 else ''}; CPU {cpu.get('parent_s', 0):.1f} s "
                 f"here + {sum((cpu.get('helpers_s') or {}).values()):.1f} s in helpers, "
                 f"busiest path {cpu.get('critical_s', 0):.1f} s)")
    return "\n".join(lines)


def _time_paper2020(est: E.Estimate, st: list) -> list[str]:
    """The time rows of the paper's Fig 2-calibrated model (``--time-model paper2020``)."""
    note = st[0].perf.get("note", "")
    lines = [f"Time per step at micro-batch {est.batch} (paper2020: the paper's V100 model "
             f"calibrated on its Fig 2, e_max {est.perf_params.get('e_max', 0):.2f}, comm_eff "
             f"{est.perf_params.get('comm_eff', 0):.2f}" + (f"; {note}" if note else "") + ")"]
    lines.append(_row("step time (s)", [s.perf["step_s"] for s in st], "{:>10.3f}"))
    for key, label in (("compute_s", "  compute"), ("tp_s", "  TP communication"),
                       ("dp_s", "  exposed DP communication"),
                       ("pa_s", "  P_a all-gathers"), ("offload_s", "  P_a+cpu copies"),
                       ("overlap_slowdown_s", "  compute slowed by hidden DP comm."),
                       ("host_s", "  host AdamW (offload)"),
                       ("pcie_s", "  exposed PCIe copies (offload)")):
        if any(s.perf.get(key) for s in st) or key in ("compute_s", "dp_s"):
            lines.append(_row(label, [s.perf.get(key, 0.0) for s in st], "{:>10.3f}"))
    lines.append(_row("tokens/s (cluster)", [s.perf["tokens_per_s"] for s in st],
                      "{:>10,.0f}"))
    lines.append(_row("MFU (model FLOPs, no recompute)", [s.perf["mfu"] for s in st],
                      "{:>10.1%}"))
    lines.append(_row("DP traffic per rank and step (GB)", [s.perf["dp_bytes"] / GB
                                                           for s in st]))
    lines.append(_row("TP traffic per rank and step (GB)", [s.perf["tp_bytes"] / GB
                                                           for s in st]))
    lines.append(_row("tokens/s at the largest micro-batch",
                      [s.perf_max.get("tokens_per_s", "-") for s in st], "{:>10,.0f}"))
    lines.append(_row("MFU at the largest micro-batch",
                      [s.perf_max.get("mfu", "-") for s in st], "{:>10.1%}"))
    return lines


def _link_rows(st: list) -> list[str]:
    """The DP traffic inside a node and between nodes (ring, ``scale.hsdp``)."""
    return [_row("  inside a node (ring, GB)", [s.perf["dp_intra_bytes"] / GB for s in st]),
            _row("  between nodes (ring, GB)", [s.perf["dp_inter_bytes"] / GB for s in st])]


def _band(lo: float, hi: float, fmt: str) -> str:
    return f"{fmt.format(lo)}-{fmt.format(hi)}"


def _kband(lo: float, hi: float) -> str:
    """A band of counts in a 10-character cell, a space before it: 922-1071, 40-44k."""
    if hi < 1e4:
        return _band(lo, hi, "{:.0f}")
    return _band(lo / 1e3, hi / 1e3, "{:.0f}") + "k"


def _time_modern(est: E.Estimate, st: list) -> list[str]:
    """The time rows of the modern stack's model: step time with its band, the three largest
    terms of every stage, tokens/s and MFU / HFU with their bands (``scale.modern_step``)."""
    p0, tm = st[0].perf, est.timing
    spec = gpus.gpu(p0["gpu"])
    ac = p0["ac"] + (f" (every {p0['every']} blocks)" if p0["ac"] == "selective" else "")
    lines = [f"Time per step at micro-batch {est.batch} (modern stack on {spec.name}: kernel "
             f"model from sourced benchmarks, nothing fitted; {tm['attention']} attention, "
             f"causal; activation checkpointing {ac}; band = the spread of the kernel inputs)"]
    lines.append(_row("step time (s)", [s.perf["step_s"] for s in st], "{:>10.3f}"))
    lines.append(_row("  band (s)", [_band(*s.perf["step_s_band"], "{:.3g}") for s in st]))
    top = []
    for s in st:
        top += [k for k, _, _ in s.perf["largest"] if k not in top]
    for k in top + [k for k in ("dp_exposed", "overlap_slowdown") if k not in top]:
        lines.append(_row(f"  {_TERM_LABEL.get(k, k)}",
                          [f"{s.perf['terms'][k]:.2f} {s.perf['terms'][k] / s.perf['step_s']:>3.0%}"
                           for s in st]))
    lines.append(_row("tokens/s (cluster)", [s.perf["tokens_per_s"] for s in st],
                      "{:>10,.0f}"))
    lines.append(_row("tokens/s per GPU", [s.perf["tokens_per_s_gpu"] for s in st],
                      "{:>10,.0f}"))
    n = est.world_size
    lines.append(_row("  band", [_kband(s.perf["band"]["low"]["tokens_per_s"] / n,
                                        s.perf["band"]["high"]["tokens_per_s"] / n)
                                 for s in st]))
    lines.append(_row("MFU (6N + 12·l·h·s per token)", [s.perf["mfu"] for s in st],
                      "{:>10.1%}"))
    lines.append(_row("  band", [_band(100 * s.perf["band"]["low"]["mfu"],
                                       100 * s.perf["band"]["high"]["mfu"], "{:.0f}") + "%"
                                 for s in st]))
    lines.append(_row("HFU (with the recompute)", [s.perf["hfu"] for s in st], "{:>10.1%}"))
    lines.append(_row("DP traffic per rank and step (GB)", [s.perf["dp_bytes"] / GB
                                                           for s in st]))
    lines += _link_rows(st)
    lines.append(_row("TP traffic per rank and step (GB)", [s.perf["tp_bytes"] / GB
                                                           for s in st]))
    if est.offload != "none":
        lines.append(_row("PCIe traffic per rank and step (GB)",
                          [s.perf["pcie_bytes"] / GB for s in st]))
        lines.append(_row("  PCIe copies, hidden or not (s)",
                          [s.perf["pcie_total_s"] for s in st], "{:>10.2f}"))
        lines.append(_row("  host AdamW (s)", [s.perf["terms"]["host_adam"] for s in st],
                          "{:>10.2f}"))
    lines.append(_row("tokens/s per GPU at the largest batch",
                      [s.perf_max.get("tokens_per_s_gpu", "-") for s in st], "{:>10,.0f}"))
    lines.append(_row("MFU at the largest micro-batch",
                      [s.perf_max.get("mfu", "-") for s in st], "{:>10.1%}"))
    return lines


_TERM_LABEL = {"gemm_fwd": "GEMMs forward", "gemm_bwd": "GEMMs backward",
               "attention_fwd": "attention forward", "attention_bwd": "attention backward",
               "memory_bound_fwd": "memory-bound forward",
               "memory_bound_bwd": "memory-bound backward", "recompute": "recompute",
               "optimizer": "optimizer step", "tp_comm": "TP communication",
               "dp_exposed": "exposed DP communication", "pa_comm": "P_a all-gathers",
               "cpu_offload": "P_a+cpu copies", "host_adam": "host AdamW (offload)",
               "pcie_exposed": "exposed PCIe copies (offload)",
               "overlap_slowdown": "compute slowed by hidden DP comm."}


_ZR_LABEL = {"ckpt": "activation checkpointing + C_B + M_D",
             "selective": "selective activation checkpointing (every k-th block) + C_B + M_D",
             "pa": "activation checkpointing + P_a + C_B + M_D",
             "pa_cpu": "activation checkpointing + P_a+cpu + C_B + M_D",
             "none": "no activation checkpointing, C_B + M_D"}


def _nominal(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)\s*([BT])", text or "")
    return float(m.group(1)) * {"B": 1e9, "T": 1e12}[m.group(2)] if m else 0.0


def run(cfg: C.Config, stages=(0, 1, 2, 3), zero_r: str = "auto", search: bool = True,
        workers: int | None = None, timing: T.Timing | None = None,
        offload: str = "none", shard_size: str | None = None,
        hpz: bool = False) -> tuple[E.Estimate, dict]:
    """The estimate and DeepSpeed's figures (empty without DeepSpeed) for ``cfg`` with
    offload mode ``offload`` (``C.OFFLOAD_MODES``), ``zero.shard_size`` ``shard_size`` and
    hpZ at stage 3 where ``hpz``."""
    est = E.estimate(cfg, stages, zero_r, search=search, workers=workers,
                     timing=timing or T.Timing(), offload=offload, shard_size=shard_size,
                     hpz=hpz)
    m, p = cfg.model, cfg.parallel
    ds = deepspeed_figures(est.stages[0].psi_rank, p.world_size // p.tp,
                           cfg.cluster.gpus_per_node // p.tp, largest_layer(m, p.tp),
                           offload=offload != "none", offload_param="param" in offload)
    return est, ds


def as_json(est: E.Estimate, ds: dict) -> dict:
    d = dataclasses.asdict(est)
    d["deepspeed"] = {str(k): v for k, v in ds.items()}
    return d


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m zero_repro.lab.estimate",
        description="Will it fit, which ZeRO stage, how fast: per-rank memory of stages 0-3 "
                    "(dry run + caching-allocator replay), the largest micro-batch that fits, "
                    "step time over the cluster's links, and a recommendation.")
    ap.add_argument("--model", help="conf/model/NAME (e.g. llama2_7b, llama3_70b, gpt_8b)")
    ap.add_argument("--shape", help="a model by shape: layers=,hidden=,heads=[,kv_heads=,ffn=,"
                                    "vocab=,seq=,theta=,family=llama|gpt]")
    ap.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    ap.add_argument("--cluster", help=f"conf/cluster/NAME ({', '.join(list_clusters())})")
    ap.add_argument("--device-memory", help="device memory, e.g. 48GB or 80GiB")
    ap.add_argument("--gpus-per-node", type=int)
    ap.add_argument("--peak-tflops", type=float, help="dense bf16/fp16 peak per GPU")
    ap.add_argument("--intra-gbps", type=float, help="GB/s per GPU in a node (both directions)")
    ap.add_argument("--inter-gbps", "--inter-node-gbps", type=float, dest="inter_gbps",
                    help="Gbit/s per node between nodes (overrides the cluster's)")
    ap.add_argument("--pcie-gbps", type=float, help="GB/s host <-> device")
    ap.add_argument("--gpu", help=f"the GPU kind ({', '.join(gpus.known())}; default: the "
                                  "cluster's): the time model's, and without --cluster its "
                                  "datasheet facts make the cluster")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in all (TP x DP)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    ap.add_argument("--batch", type=int, default=1, help="micro-batch per GPU (sequences)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--zero-r", default="auto",
                    help=f"auto | {' | '.join(E.ZERO_R)}, or several, comma-separated")
    ap.add_argument("--ac", choices=("none", "selective", "full"),
                    help="activation checkpointing (default: full, or none with --zero-r none)")
    ap.add_argument("--every", type=int, default=2,
                    help="--ac selective: every k-th block checkpointed (default 2)")
    ap.add_argument("--attention", default="flash", choices=("flash", "unfused"))
    ap.add_argument("--time-model", default="modern", choices=T.MODELS,
                    help="modern (today's stack, kernel model) or paper2020 (the paper's "
                         "Fig 2-calibrated V100 model)")
    ap.add_argument("--collectives", default="nccl", choices=("nccl", "ring"),
                    help="modern time model: NCCL's cost model per call (latency, protocol, "
                         "message size; scale.collectives) or the ring closed forms")
    ap.add_argument("--no-overlap-slowdown", action="store_true",
                    help="leave out the compute slowed by the collectives it hides "
                         "(scale.overlap)")
    ap.add_argument("--offload", default="none",
                    help="none | cpu (ZeRO-Offload: the optimizer on the host) | param (stage "
                         "3's parameter shard on the host) | cpu+param, or several: none,cpu")
    ap.add_argument("--shard-size", default="all",
                    help="zero.shard_size of stages 1-3: all (plain ZeRO) | node | G")
    ap.add_argument("--hpz", action="store_true",
                    help="stage 3 with ZeRO++'s hpZ (a secondary parameter shard per node; "
                         "the primary partition over every DP rank)")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--bucket", type=int, help="C_B bucket elements (default 5e8)")
    ap.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
    ap.add_argument("--workers", type=int, help="helper processes (default: 2 on 2+ cores)")
    ap.add_argument("--json", help="also write the estimate as JSON here (every time term)")
    ap.add_argument("--snapshot", metavar="FILE", help="also write each stage's dry run as a "
                    "PyTorch memory snapshot (FILE, or FILE_stageN per stage; lab.memory_view)")
    return ap


def settings_of(args, tp: int) -> list[str]:
    """The ZeRO-R settings of ``--zero-r`` and ``--ac`` (``--ac none`` is ZeRO-R none,
    ``selective`` the selective setting, ``full`` any checkpointing one), validated."""
    zrs = [z.strip() for z in args.zero_r.split(",") if z.strip()]
    if args.ac in ("none", "selective"):
        if any(z not in ("auto", args.ac) for z in zrs):
            raise ValueError(f"--ac {args.ac} with --zero-r {args.zero_r}: give one of them")
        zrs = [args.ac]
    elif args.ac == "full" and any(z in ("none", "selective") for z in zrs):
        raise ValueError(f"--ac full with --zero-r {args.zero_r}: give one of them")
    for zr in zrs or ["?"]:
        E.zero_r_name(zr, tp)
    return zrs


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        stages = tuple(sorted({int(s) for s in args.stages.split(",")}))
        if not set(stages) <= {0, 1, 2, 3}:
            raise ValueError(f"--stages {args.stages!r}: stages are 0..3")
        cfg = config_from_args(args)
        settings = settings_of(args, cfg.parallel.tp)
        shard = SH.shard_size_arg(args, cfg)
        timing = T.Timing(model=args.time_model, gpu=args.gpu or "", attention=args.attention,
                          every=args.every, collectives=args.collectives,
                          overlap_slowdown=not args.no_overlap_slowdown)
        offloads = offloads_of(args.offload, timing)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    done = []
    runs = [(zr, off) for zr in settings for off in offloads]
    for zr, off in runs:
        est, ds = run(cfg, stages, zr, not args.no_search, args.workers, timing, off, shard,
                      args.hpz)
        print(report(est, ds) + ("\n" if len(runs) > 1 else ""))
        done.append((est, ds))
    if len(done) > 1:
        print(compare_settings([e for e, _ in done]))
    if args.snapshot:
        print("\n".join(memory_view.stage_snapshots(cfg, stages, runs[0][0], args.snapshot, runs[0][1])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([as_json(e, d) for e, d in done] if len(done) > 1
                      else as_json(*done[0]), f, indent=1, default=str)
    return 0


def offloads_of(text: str, timing: T.Timing) -> list[str]:
    """The ``--offload`` settings, validated (either time model times the host step)."""
    offs = [o.strip() for o in text.split(",") if o.strip()]
    if not offs or any(o not in C.OFFLOAD_MODES for o in offs):
        raise ValueError(f"--offload {text!r}: use one or more of {', '.join(C.OFFLOAD_MODES)}"
                         f" (e.g. none,cpu,cpu+param)")
    return list(dict.fromkeys(offs))


_OFFLOAD_LABEL = {"none": "", "cpu": ", optimizer offloaded to the host",
                  "param": ", stage 3's parameters offloaded to the host",
                  "cpu+param": ", optimizer and stage 3's parameters offloaded to the host"}


def _label(est: E.Estimate) -> str:
    return _ZR_LABEL[est.zero_r] + _OFFLOAD_LABEL[est.offload]


def compare_settings(ests: list[E.Estimate]) -> str:
    """One line per ZeRO-R / offload setting: its recommended stage and the tokens/s there at
    the largest micro-batch; the fastest of them."""
    lines, best = ["Settings compared (each at its recommended stage's largest "
                   "micro-batch):"], None
    for est in ests:
        stage = est.recommendation[0]
        s = next((x for x in est.stages if x.stage == stage), None)
        tps = s.perf_max.get("tokens_per_s") if s is not None else None
        lines.append(f"  {_label(est)}: " + (
            f"stage {stage}, micro-batch {s.max_batch}, {tps:,.0f} tokens/s" if tps else
            "no stage fits" if stage is None else f"stage {stage}"))
        if tps and (best is None or tps > best[1]):
            best = (_label(est), tps)
    if best:
        lines.append(f"  fastest: {best[0]}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

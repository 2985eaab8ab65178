"""The peers race's ``report.md``, rendered from the experiment's table alone (``experiments.peers``
``summarize`` rows): the speed tables (step time, distance to the lower bound and to the best peer
at the stage, with the spread of the repeats), the memory table (live-storage peak beside max RSS),
the budget table (the largest model within a per-rank budget) and how to read them. Goals quoted
are ``report.GOAL_BOUND`` and ``report.GOAL_RATIO``.
"""
from __future__ import annotations

import json
import os

from zero_repro.lab.peers import report


def _spread(xs) -> str:
    xs = [x for x in xs or [] if x is not None]
    return f"{min(xs):.3f}-{max(xs):.3f}" if xs else ""


def repeats_of(v) -> list[float]:
    """The repeats of a table cell (a JSON list, or empty)."""
    return json.loads(v) if isinstance(v, str) and v else []


def pd_numeric(s):
    import pandas as pd

    return pd.to_numeric(s, errors="coerce")


def _fmt(v, fmt: str) -> str:
    return format(v, fmt) if v is not None and v == v else "-"


def _speed_table(t, table: str) -> list[str]:
    d = t[t["table"] == table]
    if d.empty:
        return ["(not measured)"]
    wide = d.pivot_table(index=["model", "stage", "x_value"], columns="y_name", values="y",
                         aggfunc="first").reset_index()
    reps = d.set_index(["model", "x_value", "y_name"])["repeats"]
    peer = d.drop_duplicates(["model", "x_value"]).set_index(["model", "x_value"])
    detail = d[d["y_name"] == "max_abs_dparam"].set_index(["model", "x_value"])["detail"]
    lines = ["| model | stage | framework | median step [s] (3 repeats) | / lower bound "
             "(repeats) | / best peer (repeats) | best peer | / DDP | peak [MiB/rank] | "
             "process set | max abs dθ | tolerance ratio | equivalence |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in wide.sort_values(["model", "stage", "x_value"]).iterrows():
        key = (r["model"], r["x_value"])

        def rep(y):
            return _spread(repeats_of(reps.get((*key, y), "")))

        lines.append(
            f"| {r['model']} | {r['stage'] if r['stage'] >= 0 else '-'} | {r['x_value']} | "
            f"{_fmt(r.get('step_time_s'), '.3f')} ({rep('step_time_s')}) | "
            f"{_fmt(r.get('ratio_to_bound'), '.2f')} ({rep('ratio_to_bound')}) | "
            f"{_fmt(r.get('ratio_to_best_peer'), '.2f')} ({rep('ratio_to_best_peer')}) | "
            f"{peer.loc[key, 'best_peer'] or '-'} | {_fmt(r.get('ratio_to_ddp'), '.2f')} | "
            f"{_fmt(_mib(r.get('live_peak_bytes')), '.0f')} | "
            f"{peer.loc[key, 'process_set']} | {_fmt(r.get('max_abs_dparam'), '.1e')} | "
            f"{_fmt(r.get('tolerance_ratio'), '.2f')} | {detail.get(key, '') or '-'} |")
    return lines


def _mib(v):
    return None if v is None or v != v else v / 2**20


def _memory_table(t) -> list[str]:
    d = t[t["table"] == "memory"]
    if d.empty:
        return ["(not measured)"]
    wide = d.pivot_table(index=["model", "stage", "x_value"], columns="y_name", values="y",
                         aggfunc="first").reset_index()
    peer = d[d["y_name"] == "memory_to_best_peer"].set_index("x_value")["best_peer"]
    lines = ["| model | stage | framework | live peak [MiB/rank] | max RSS [MiB] | "
             "RSS growth [MiB] | / best peer's peak | best peer |", "|---|---|---|---|---|---|---|---|"]
    for _, r in wide.sort_values(["model", "stage", "x_value"]).iterrows():
        lines.append(f"| {r['model']} | {r['stage']} | {r['x_value']} | "
                     f"{_fmt(_mib(r.get('live_peak_bytes')), '.0f')} | "
                     f"{_fmt(_mib(r.get('max_rss_bytes')), '.0f')} | "
                     f"{_fmt(_mib(r.get('rss_growth_bytes')), '.0f')} | "
                     f"{_fmt(r.get('memory_to_best_peer'), '.2f')} | "
                     f"{peer.get(r['x_value'], '') or '-'} |")
    return lines


def _budget_table(t) -> list[str]:
    d = t[(t["table"] == "budget") & (t["y_name"] == "max_params_in_budget")]
    if d.empty:
        return ["(not measured)"]
    lines = ["| stage | framework | largest model within the budget | parameters [M] | "
             "live peak per size climbed (largest rank) |", "|---|---|---|---|---|"]
    for _, r in d.sort_values(["stage", "x_value"]).iterrows():
        lines.append(f"| {r['stage']} | {r['x_value']} | {r['model']} | {r['y'] / 1e6:.1f} | "
                     f"{r['detail']} |")
    return lines


def _load_line(t, table: str) -> list[str]:
    if "loadavg_1min" not in t:
        return []
    loads = {str(x) for x in t.loc[t["table"] == table, "loadavg_1min"].dropna() if str(x)}
    return ["", f"1-minute load average during this table: {', '.join(sorted(loads))}."] \
        if loads else []


def _split_line(t) -> list[str]:
    """What ``zero.split_tied_grad`` did in the records shown (a bullet of the report)."""
    if "split_tied_grad" not in t:
        return []
    on = set(t["split_tied_grad"].dropna().astype(bool))
    if on == {False}:
        return ["- zero_repro ran with `zero.split_tied_grad` off: autograd's dense tied "
                "gradient, as every peer and the lower bound."]
    return ["- zero_repro's stages 0-2 ran with `zero.split_tied_grad` "
            f"{'on' if on == {True} else 'on in some records, off in others'} "
            "(conf/exp/peers.yaml): the tied embedding's gradient is taken as the LM head's "
            "GEMM, written straight where the stage keeps gradients (stage 2: the fused "
            "buckets, reduce-scattered as soon as the head's backward ran), plus the lookup's "
            "B·s rows (stage 2: all-gathered sparse, N_d·B·s·(h+1) elements beyond 2Ψ); no "
            "dense V×h gradient is formed. The peers and the lower bound run plain autograd, "
            "which forms it (zeros plus the rows, summed with the head's), so at stages 0-2 "
            "`/ lower bound` also credits zero_repro with that work avoided. Its effect alone: "
            "`python -m zero_repro.lab.bench --ab split_tied_grad` (results/peers/overlap_ab.md)."]


def write_report(t, out_dir: str) -> str:
    lines = ["# Peers: measured step time, memory, distance to the lower bound and equivalence",
             "", "World 2, fp32, CPU/gloo on a 2-core machine. Frameworks of one process set "
             "are interleaved step by step, so load from other programs hits them alike; the "
             "spread of 3 repeats (the medians of 3 consecutive blocks of the timed steps) is "
             "shown in brackets. Under each table: the 1-minute load average sampled while it "
             "ran (the race's own 2 ranks keep it near 2 on 2 cores; well above 2 means other "
             "programs were running).", "",
             "## Same kernel: every peer with torch.optim.AdamW(fused=True)", "",
             *_speed_table(t, "same_kernel"), *_load_line(t, "same_kernel"), "",
             "## As shipped: the peers' default optimizers (zero_repro's fused AdamW as always)",
             "", *_speed_table(t, "as_shipped"), *_load_line(t, "as_shipped"), "",
             "## Size series (stages 2 and 3, fused AdamW, few steps, no reference)", "",
             *_speed_table(t, "size"), *_load_line(t, "size"), "",
             "## Memory: every framework in a process of its own", "",
             *_memory_table(t), *_load_line(t, "memory"), "",
             "## The largest model each framework trains within a per-rank memory budget", "",
             *_budget_table(t), *_load_line(t, "budget"), "",
             "## How to read it", "",
             "- `lower_bound`: the same per-rank micro-batch's forward + backward with no "
             "communication, plus the fused AdamW on Ψ/N_d elements; `/ lower bound` is every "
             "framework's distance to it (goal for zero_repro: <= "
             f"{report.GOAL_BOUND:.2f}).", *_split_line(t),
             "- `/ best peer`: the fastest other framework at the same ZeRO stage (goal "
             "for zero_repro: <= 0.95 at stages 0-1, <= 0.80 at stages 2-3). Within a process "
             "set the step times are divided directly; across sets through each set's lower "
             "bound.",
             "- Transport: every peer's collectives run on torch's gloo backend (loopback "
             "TCP sockets). `zero_repro_sk` moves its DP buckets through shared memory "
             "(`runtime.comm.cpu.shm`, gloo ranks on one host; `ZR_CPU_TRANSPORT`), "
             "`zero_repro_sk_p2p` through gloo point-to-point sends, as the peers' travel: the "
             "`_p2p` rows race the implementations on one transport, the plain ones show what "
             "the transport adds. Both skip the global gradient norm (unclipped fp32: it "
             "would only be logged, and DDP / FSDP2 compute none; DeepSpeed computes its own).",
             "- Process sets: DeepSpeed ZeRO-3 replaces `torch.nn.functional.linear` for the "
             "whole process (measured with DeepSpeed 0.19.8; ZeRO-1/2 patch nothing), so it "
             "runs in a process set of its own and no other framework runs through its linear "
             "(isolated, not assumed harmless). The size series runs one set per stage (fewer "
             "model copies per process).",
             "- Memory, one accounting for every framework: the peak of the live bytes of the "
             "tensor storages the framework created (a TorchDispatchMode that counts each "
             "storage an op creates until it dies and follows `UntypedStorage.resize_`; a "
             "storage mapped from a shared file counts 1/N on each of the N ranks mapping it, "
             "as the kernel's proportional set size does), over its build and its untimed "
             "warm-up steps, largest rank. `max RSS` (the process's peak resident set, which "
             "also holds Python, torch and gloo) and its growth over the process before the "
             "build are the cross-check; they are per framework only in the memory table, "
             "where each framework runs in a process of its own. `conf/exp/peers.yaml` runs "
             "zero_repro with C_B (constant buffers; the zero section's bucket sizes, which "
             "DeepSpeed is given too) and M_D; records from before the memory columns ran it "
             "without them, and their peak column is empty (-).",
             "- Budget: the ladder of GPT shapes (seq 64, micro-batch 4 per rank) climbed "
             "from the smallest until a size's live peak exceeds the per-rank budget on some "
             "rank: the paper's Figure 6 question (the largest model per configuration) "
             "measured on this machine.",
             "- Equivalence: per element |θ_f - θ_ref| <= 0.05·lr·(s+1) + B_e(s), B_e the "
             "conditioning budget Σ_k lr·min(2, 2δ_k/(√v̂_k+eps)), δ_k = 1e-5·max|g_k| of the "
             "tensor (fp32 rounding of a gradient summed in another order). Adam divides that "
             "rounding by ~eps where a gradient is below eps, so such an element may flip its "
             "first update's sign in any framework, DDP included; elsewhere B_e ~ 0 and a real "
             "bug (~lr per step on many elements) is still caught. `tolerance ratio` = max "
             "|Δθ|/allowed (<= 1: equivalent)."]
    path = os.path.join(out_dir, "report.md")
    with open(path + ".tmp", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)
    return path

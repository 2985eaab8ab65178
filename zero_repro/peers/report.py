"""Equivalence and speed reports for the peer comparison (paper §5/§7 claims checked against
torch DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed and this project's stages).

Input: the per-rank results of ``runners.run_peers`` (one dict per rank). Output: plain dicts
(JSON-able, stored in the record) and a text rendering.

Equivalence (fp32): for every framework f and step s,
  loss:   |L_f(s) - L_ref(s)| <= loss_tol, with L_f(s) the mean of the ranks' local losses
          (equal rank batches, so it is the global-batch mean) and L_ref(s) the reference's;
  params: max over ranks and tensors of max |θ_f(s) - θ_ref(s)| <= param_tol(s),
          param_tol(s) = param_tol_rel_lr · lr · (s + 1).
The tolerance grows with the step count and scales with the learning rate because the fp32
noise is rounding in a different reduction order (DP ranks sum half-batch gradients) that
AdamW turns into a parameter change of at most ~lr per step on elements whose gradient is
near eps; a real bug (a shard not updated, a wrong slice) moves parameters by ~lr at once.
The first (step, tensor, rank) beyond tolerance is named.

Speed: median over timed steps (after warm-up; the comm-counted step excluded) of the step
time, a step's time being the slowest rank's. ``ratio_to_best_peer`` divides by the fastest
*other-framework* peer at the same ZeRO stage; ``ratio_to_ddp`` by torch DDP. The project's
goal: zero_repro stage k <= 0.9 × the best peer at stage k.
"""
from __future__ import annotations

import math
import statistics

from zero_repro.peers.runners import FRAMEWORKS

GOAL_RATIO = 0.9


def _finite(xs) -> list[float]:
    return [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]


def equivalence(results: list[dict], lr: float, param_tol_rel_lr: float = 0.05,
                loss_tol: float = 1e-4) -> dict:
    """Per framework: per-step loss and |Δloss|, per-step max |Δparam| (over ranks), and the
    first step/tensor/rank beyond tolerance (``first_divergence``, None if none)."""
    results = sorted(results, key=lambda r: r["rank"])
    ref_losses = results[0]["reference_losses"]
    out = {}
    for name in results[0]["frameworks"]:
        per_rank = [r["frameworks"][name] for r in results]
        losses = [statistics.fmean(v) for v in zip(*(t["losses"] for t in per_rank))]
        dloss = [abs(a - b) for a, b in zip(losses, ref_losses)]
        dparam, where, first = [], [], None
        for s in range(len(losses)):
            tol = param_tol_rel_lr * lr * (s + 1)
            best, best_at = None, None
            for rank, t in enumerate(per_rank):
                d = t["dparam"][s]
                if d is None:
                    continue
                val, tensor = d
                if best is None or not val <= best:  # NaN counts as the worst
                    best, best_at = val, (tensor, rank)
                if first is None and not val <= tol:
                    first = {"step": s, "tensor": tensor, "rank": rank, "max_abs_dparam": val,
                             "tolerance": tol, "what": "params"}
            dparam.append(best)
            where.append(best_at)
            if first is None and not dloss[s] <= loss_tol:
                first = {"step": s, "tensor": "loss", "rank": None, "abs_dloss": dloss[s],
                         "tolerance": loss_tol, "what": "loss"}
        finite = _finite(dparam)
        out[name] = {"stage": FRAMEWORKS[name][0], "family": FRAMEWORKS[name][1],
                     "losses": losses, "reference_losses": list(ref_losses), "abs_dloss": dloss,
                     "max_abs_dparam": dparam, "worst_at": where,
                     "max_abs_dparam_all": max(finite) if finite else None,
                     "max_abs_dloss_all": max(dloss) if dloss else None,
                     "first_divergence": first, "equivalent": first is None,
                     "param_tol_rel_lr": param_tol_rel_lr, "loss_tol": loss_tol}
    return out


def speed(results: list[dict], warmup_steps: int) -> dict:
    """Per framework: step times (slowest rank per step), median after warm-up, ratios."""
    results = sorted(results, key=lambda r: r["rank"])
    out = {}
    for name in results[0]["frameworks"]:
        per_rank = [r["frameworks"][name]["step_times"] for r in results]
        steps = [max(v) for v in zip(*per_rank)]  # NaN (counted step) propagates
        timed = _finite(steps[warmup_steps:])
        out[name] = {"stage": FRAMEWORKS[name][0], "family": FRAMEWORKS[name][1],
                     "step_times_s": steps, "timed_steps": len(timed),
                     "step_time_s": statistics.median(timed) if timed else None,
                     "step_time_min_s": min(timed) if timed else None}
    _ratios(out)
    return out


def _ratios(out: dict) -> None:
    ddp = (out.get("torch_ddp") or {}).get("step_time_s")
    for name, row in out.items():
        t = row["step_time_s"]
        # the best *peer* (other framework, not this project) at the same stage
        peers = [(v["step_time_s"], n) for n, v in out.items()
                 if n != name and v["stage"] == row["stage"] and v["family"] != "zero_repro"
                 and v["step_time_s"]]
        best = min(peers) if peers else (None, None)
        row["best_peer"] = best[1]
        row["ratio_to_best_peer"] = t / best[0] if t and best[0] else None
        row["ratio_to_ddp"] = t / ddp if t and ddp else None
        if row["family"] == "zero_repro":
            r = row["ratio_to_best_peer"]
            row["goal_met"] = None if r is None else bool(r <= GOAL_RATIO)


def format_report(eq: dict, sp: dict) -> str:
    """Fixed-width text: one line per framework, by stage."""
    lines = [f"{'framework':<24}{'stage':>5}{'median s':>10}{'vs best peer':>14}"
             f"{'best peer':>24}{'vs DDP':>8}{'max|dθ|':>10}{'max|dL|':>10}  equivalence"]
    order = sorted(sp, key=lambda n: (sp[n]["stage"], sp[n]["family"] == "zero_repro", n))
    for n in order:
        s, e = sp[n], eq.get(n, {})

        def f(x, fmt):
            width = fmt.split(".")[0]
            return format(x, fmt) if isinstance(x, (int, float)) else format("-", f">{width}")

        fd = e.get("first_divergence")
        verdict = "ok" if e.get("equivalent") else (
            f"DIVERGES at step {fd['step']} in {fd['tensor']} (rank {fd['rank']})" if fd else "-")
        goal = ""
        if "goal_met" in s and s["goal_met"] is not None:
            goal = "  goal<=0.9: " + ("met" if s["goal_met"] else "NOT met")
        lines.append(f"{n:<24}{s['stage']:>5}{f(s['step_time_s'], '10.3f')}"
                     f"{f(s['ratio_to_best_peer'], '14.2f')}{str(s['best_peer'] or '-'):>24}"
                     f"{f(s['ratio_to_ddp'], '8.2f')}{f(e.get('max_abs_dparam_all'), '10.2e')}"
                     f"{f(e.get('max_abs_dloss_all'), '10.2e')}  {verdict}{goal}")
    return "\n".join(lines)

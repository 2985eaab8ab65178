"""Equivalence and speed reports of the peer comparison (paper §5/§7 claims checked against torch
DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed and this project's stages).

Input: the per-rank results of ``runners.run_peers`` for one or several process sets
(``runners.process_sets``). Output: JSON-able dicts (stored in the record) and a text rendering
(``format_report``).

Equivalence (``equivalence``, fp32), for every framework f and step s:
  loss:   |L_f(s) - L_ref(s)| <= loss_tol (L_f: the ranks' mean local loss = the global-batch
          mean; L_ref: the reference's);
  params: per element e, |θ_f(s) - θ_ref(s)| <= floor(s) + B_e(s), floor(s) = param_tol_rel_lr ·
          lr · (s + 1), B_e(s) the conditioning budget (``frameworks.Reference``) Σ_k lr ·
          min(2, 2δ_k / (√v̂_k,e + eps)), δ_k = grad_rounding_rel · max |g_k| of the tensor.
The budget covers fp32 rounding of a gradient summed in another order, which Adam divides by ~eps
where |g| < eps (any framework, DDP included), while a real bug still moves well-conditioned
elements (budget ~0) by ~lr. Verdict: max_e |Δθ_e| / (floor + B_e) <= 1; the elements that
needed their budget are counted, the first (step, tensor, rank) beyond tolerance is named.

Speed (``speed``, ``speed_sets``): a step's time is the slowest rank's; ``step_time_s`` the median
over the timed steps, ``repeats_s`` the medians of ``repeats`` consecutive blocks.
``ratio_to_bound`` = t / the lower bound of the same process set; ``ratio_to_best_peer`` divides
by the fastest other framework at the same stage (directly within one set, across sets through
each set's bound); ``ratio_to_ddp`` by torch DDP. Goals (``GOAL_RATIO``, ``GOAL_BOUND``):
zero_repro stage k <= 0.95 × the best peer at stages 0-1, <= 0.80 at stages 2-3, and <= 1.15 ×
the lower bound.
"""
from __future__ import annotations

import math
import statistics

from zero_repro.lab.peers.spec import FRAMEWORKS

GOAL_RATIO = {0: 0.95, 1: 0.95, 2: 0.80, 3: 0.80}  # goal: ours / best peer, per stage
GOAL_BOUND = 1.15  # goal: ours / lower bound, every stage
BOUND = "lower_bound"


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
        if FRAMEWORKS[name][1] == "bound":
            continue  # trains nothing
        per_rank = [r["frameworks"][name] for r in results]
        losses = [statistics.fmean(v) for v in zip(*(t["losses"] for t in per_rank))]
        dloss = [abs(a - b) for a, b in zip(losses, ref_losses)]
        dparam, where, first, worst_q, n_budget = [], [], None, None, 0
        for s in range(len(losses)):
            tol = param_tol_rel_lr * lr * (s + 1)
            best, best_at = None, None
            for rank, t in enumerate(per_rank):
                d = t["dparam"][s]
                if d is None:
                    continue
                val, tensor = d[0], d[1]
                # compare()'s verdict ratio (budgeted tolerance); a bare (value, tensor) pair
                # is judged against the floor alone
                q = d[2] if len(d) > 2 else (val / tol if tol else math.inf)
                n_budget += d[3] if len(d) > 3 else 0
                worst_q = q if worst_q is None or not q <= worst_q else worst_q
                if best is None or not val <= best:  # NaN counts as the worst
                    best, best_at = val, (tensor, rank)
                if first is None and not q <= 1.0:
                    first = {"step": s, "tensor": tensor, "rank": rank, "max_abs_dparam": val,
                             "tolerance": tol, "tolerance_ratio": q, "what": "params"}
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
                     "max_tolerance_ratio": worst_q, "elements_within_budget_only": n_budget,
                     "param_tol_rel_lr": param_tol_rel_lr, "loss_tol": loss_tol}
    return out


def merge_sets(sets: list[list[dict]]) -> list[dict]:
    """One per-rank result list out of several process sets' (for ``equivalence``): the
    frameworks of every set side by side; the reference (deterministic, the same in every
    set) and the lower bound from the first set."""
    merged = []
    for per_set in zip(*(sorted(rs, key=lambda r: r["rank"]) for rs in sets)):
        fw: dict = {}
        for r in per_set:
            for n, tr in r["frameworks"].items():
                fw.setdefault(n, tr)
        merged.append({"rank": per_set[0]["rank"], "frameworks": fw,
                       "reference_losses": per_set[0]["reference_losses"]})
    return merged


def _blocks(xs: list[float], k: int) -> list[list[float]]:
    k = max(1, min(k, len(xs)))
    q, r = divmod(len(xs), k)
    out, i = [], 0
    for j in range(k):
        n = q + (1 if j < r else 0)
        out.append(xs[i:i + n])
        i += n
    return out


def _set_rows(results: list[dict], warmup_steps: int, repeats: int, set_index: int) -> dict:
    results = sorted(results, key=lambda r: r["rank"])
    out = {}
    for name in results[0]["frameworks"]:
        per_rank = [r["frameworks"][name]["step_times"] for r in results]
        steps = [max(v) for v in zip(*per_rank)]  # NaN (counted step) propagates
        timed = _finite(steps[warmup_steps:])
        reps = [statistics.median(b) for b in _blocks(timed, repeats) if b]
        out[name] = {"stage": FRAMEWORKS[name][0], "family": FRAMEWORKS[name][1],
                     "process_set": set_index, "step_times_s": steps, "timed_steps": len(timed),
                     "step_time_s": statistics.median(timed) if timed else None,
                     "step_time_min_s": min(timed) if timed else None, "repeats_s": reps}
    return out


def speed(results: list[dict], warmup_steps: int, repeats: int = 3) -> dict:
    """Per framework of one process set: step times (slowest rank per step), median after
    warm-up, ``repeats`` block medians, ratios."""
    return speed_sets([results], warmup_steps, repeats)


def speed_sets(sets: list[list[dict]], warmup_steps: int, repeats: int = 3) -> dict:
    """``speed`` over several process sets (each one ``run_peers`` spawn); a framework that
    ran in several sets (the lower bound) keeps its first set's row."""
    out: dict = {}
    bounds: list = []
    for i, results in enumerate(sets):
        rows = _set_rows(results, warmup_steps, repeats, i)
        b = rows.get(BOUND)
        bounds.append(b)
        for n, row in rows.items():
            out.setdefault(n, row)
    for row in out.values():
        b = bounds[row["process_set"]]
        bt = b and b["step_time_s"]
        row["bound_s"] = bt or None
        row["ratio_to_bound"] = row["step_time_s"] / bt if row["step_time_s"] and bt else None
        # per repeat: block i over the bound's block i of the same set (same moment in time)
        row["ratio_to_bound_repeats"] = ([t / u for t, u in zip(row["repeats_s"],
                                                                b["repeats_s"])] if b else [])
    _ratios(out)
    return out


def _ratio(a: dict, b: dict) -> tuple[float | None, list]:
    """a's step time over b's: direct within one process set, via the bounds across sets."""
    if a["process_set"] == b["process_set"]:
        if not (a["step_time_s"] and b["step_time_s"]):
            return None, []
        return (a["step_time_s"] / b["step_time_s"],
                [x / y for x, y in zip(a["repeats_s"], b["repeats_s"])])
    if not (a["ratio_to_bound"] and b["ratio_to_bound"]):
        return None, []
    return (a["ratio_to_bound"] / b["ratio_to_bound"],
            [x / y for x, y in zip(a["ratio_to_bound_repeats"], b["ratio_to_bound_repeats"])])


def _ratios(out: dict) -> None:
    ddp = out.get("torch_ddp")
    for name, row in out.items():
        # the best *peer* (other framework, not this project) at the same stage
        cands = [v for n, v in out.items()
                 if n != name and v["stage"] == row["stage"] and v["stage"] >= 0
                 and v["family"] not in ("zero_repro", "bound", "hybrid") and v["step_time_s"]]
        # on the bound's scale when every candidate has one (they may come from different
        # process sets), else raw step time (one set)
        key = "ratio_to_bound" if all(v["ratio_to_bound"] for v in cands) else "step_time_s"
        peers = [(v[key], n) for n, v in out.items() if any(v is c for c in cands)]
        best = min(peers)[1] if peers else None
        row["best_peer"] = best
        row["ratio_to_best_peer"], row["ratio_to_best_peer_repeats"] = (
            _ratio(row, out[best]) if best else (None, []))
        row["ratio_to_ddp"] = _ratio(row, ddp)[0] if ddp else None
        if row["family"] == "zero_repro":
            r, g = row["ratio_to_best_peer"], GOAL_RATIO.get(row["stage"])
            row["goal_ratio"] = g
            row["goal_met"] = None if r is None or g is None else bool(r <= g)
            rb = row["ratio_to_bound"]
            row["goal_bound_met"] = None if rb is None else bool(rb <= GOAL_BOUND)


def format_report(eq: dict, sp: dict) -> str:
    """Fixed-width text: one line per framework, by stage."""
    lines = [f"{'framework':<24}{'stage':>5}{'median s':>10}{'vs bound':>9}{'vs best peer':>14}"
             f"{'best peer':>24}{'vs DDP':>8}{'max|dθ|':>10}{'max|dL|':>10}  equivalence"]
    order = sorted(sp, key=lambda n: (sp[n]["stage"], sp[n]["family"] == "zero_repro", n))
    for n in order:
        s, e = sp[n], eq.get(n, {})

        def f(x, fmt):
            width = fmt.split(".")[0]
            return format(x, fmt) if isinstance(x, (int, float)) else format("-", f">{width}")

        fd = e.get("first_divergence")
        verdict = "-" if not e else "ok" if e.get("equivalent") else (
            f"DIVERGES at step {fd['step']} in {fd['tensor']} (rank {fd['rank']})" if fd else "-")
        goal = ""
        if s.get("goal_met") is not None:
            goal = (f"  goal <= {s['goal_ratio']:.2f} x best peer: "
                    + ("met" if s["goal_met"] else "NOT met"))
        if s.get("goal_bound_met") is not None:
            goal += f"; <= {GOAL_BOUND:.2f} x bound: " + ("met" if s["goal_bound_met"]
                                                           else "NOT met")
        lines.append(f"{n:<24}{s['stage']:>5}{f(s['step_time_s'], '10.3f')}"
                     f"{f(s.get('ratio_to_bound'), '9.2f')}"
                     f"{f(s['ratio_to_best_peer'], '14.2f')}{str(s['best_peer'] or '-'):>24}"
                     f"{f(s['ratio_to_ddp'], '8.2f')}{f(e.get('max_abs_dparam_all'), '10.2e')}"
                     f"{f(e.get('max_abs_dloss_all'), '10.2e')}  {verdict}{goal}")
    return "\n".join(lines)

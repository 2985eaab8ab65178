"""Running the peers race's points (``experiments/peers/`` plans them): a race of frameworks
interleaved step by step (``run_race``), each framework alone for its memory (``run_memory``),
and the ladder climbed within a per-rank budget (``run_budget``); each spawns the ranks
(``runners.run_peers`` / ``run_budget``) and returns a record's payload.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from zero_repro import config as C
from zero_repro.lab.peers import report
from zero_repro.lab.peers.runners import process_sets, run_budget as budget_ranks, run_peers
from zero_repro.lab.peers.spec import PATCHES_TORCH, PeerSpec
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.model.flops import param_count

log = logging.getLogger(__name__)


def ladder_model(n_layer: int, n_embd: int, like) -> C.ModelConfig:
    """One GPT shape of the budget ladder: ``n_layer`` x ``n_embd`` (heads of 64), the rest of
    ``like`` (vocabulary, sequence)."""
    return dataclasses.replace(like, name=f"gpt_{n_layer}x{n_embd}", n_layer=n_layer,
                               n_embd=n_embd, n_head=max(1, n_embd // 64), nominal="")


def _spec(cfg, **kw) -> PeerSpec:
    return PeerSpec(cfg.model, cfg.train, cfg.zero, zero_r=cfg.zero_r, **kw)


def run_memory(cfg, pp: dict) -> dict:
    """Every framework alone (its own spawn): live peak, max RSS, RSS before its build."""
    out, load = {}, [os.getloadavg()[0]]
    for fw in pp["frameworks"]:
        res = spawn(run_peers, cfg.parallel.world_size,
                    _spec(cfg, frameworks=(fw,), reference=False, optimizer="fused"),
                    backend=cfg.cluster.backend, timeout_s=cfg.launcher.collective_timeout_s)
        res = sorted(res, key=lambda r: r["rank"])
        out[fw] = {"live_peak": [r["frameworks"][fw]["live_peak"] for r in res],
                   "max_rss": [r["max_rss"] for r in res],
                   "rss_before": [r["rss_before"] for r in res],
                   "held": [r["frameworks"][fw]["memory"] for r in res]}
        load.append(os.getloadavg()[0])
    log.info("peers memory (world %d, %s, measured): %s", cfg.parallel.world_size,
             cfg.model.name, {f: f"{max(v['live_peak']) / 2**20:.0f} MiB" for f, v in out.items()})
    return {"metrics": {"table": "memory", "model": cfg.model.name,
                        "params": param_count(cfg.model), "memory_peak": out,
                        "loadavg_1min": load}}


def run_budget(cfg, pp: dict) -> dict:
    """Per framework (its own spawn): the ladder climbed until a size's live peak exceeds the
    per-rank budget on some rank."""
    ladder = [ladder_model(n, h, cfg.model) for n, h in pp["ladder"]]
    params = {m.name: param_count(m) for m in ladder}
    train = dataclasses.replace(cfg.train, warmup_steps=int(pp["steps"]))
    out, load = {}, [os.getloadavg()[0]]
    for fw in pp["frameworks"]:
        spec = PeerSpec(cfg.model, train, cfg.zero, frameworks=(fw,), reference=False,
                        zero_r=cfg.zero_r)
        res = sorted(spawn(budget_ranks, cfg.parallel.world_size, spec, ladder, pp["rank_bytes"],
                           backend=cfg.cluster.backend,
                           timeout_s=cfg.launcher.collective_timeout_s), key=lambda r: r["rank"])
        sizes = [{"model": s0["model"], "params": params[s0["model"]],
                  "live_peak": max(r["sizes"][i]["live_peak"] for r in res),
                  "max_rss": max(r["sizes"][i]["max_rss"] for r in res), "fits": s0["fits"]}
                 for i, s0 in enumerate(res[0]["sizes"])]
        fit = [s0 for s0 in sizes if s0["fits"]]
        out[fw] = {"sizes": sizes, "largest": fit[-1]["model"] if fit else "",
                   "largest_params": fit[-1]["params"] if fit else 0,
                   "rss_before": max(r["rss_before"] for r in res)}
        load.append(os.getloadavg()[0])
        log.info("peers budget %s: largest within %.2f GB per rank: %s", fw,
                 pp["rank_bytes"] / 1e9, out[fw]["largest"] or "none")
    return {"metrics": {"table": "budget", "rank_bytes": pp["rank_bytes"],
                        "ladder": [{"model": m.name, "params": params[m.name],
                                    "n_layer": m.n_layer, "n_embd": m.n_embd} for m in ladder],
                        "budget": out, "loadavg_1min": load}}


def run_race(cfg, pp: dict) -> dict:
    """One race point (``pp``: table, frameworks, optimizer, reference, by_stage): every process
    set spawned in turn, the equivalence and speed tables; the record's payload."""
    p = cfg.experiment.params
    spec = _spec(cfg, optimizer=pp["optimizer"],
                    reference=bool(pp.get("reference", True)),
                    digest_every=int(p.get("digest_every", 1)),
                    param_tol_rel_lr=float(p.get("param_tol_rel_lr", 0.05)),
                    grad_rounding_rel=float(p.get("grad_rounding_rel", 1e-5)))
    sets = process_sets(pp["frameworks"], by_stage=bool(pp.get("by_stage")))
    load = [os.getloadavg()[0]]
    results = []
    for fws in sets:  # one set of processes each (a patching framework alone + the bound)
        log.info("peers: process set %s", fws)
        results.append(spawn(run_peers, cfg.parallel.world_size,
                             PeerSpec(**{**vars(spec), "frameworks": tuple(fws)}),
                             backend=cfg.cluster.backend,
                             timeout_s=cfg.launcher.collective_timeout_s))
        load.append(os.getloadavg()[0])
    repeats = int(p.get("repeats", 3))
    eq = (report.equivalence(report.merge_sets(results), cfg.train.lr,
                             spec.param_tol_rel_lr, float(p.get("loss_tol", 1e-4)))
          if spec.reference else {})
    sp = report.speed_sets(results, cfg.train.warmup_steps, repeats)
    log.info("peers %s (world %d, %s, fp32, %s AdamW, measured):\n%s", pp["table"],
             cfg.parallel.world_size, cfg.model.name, spec.optimizer,
             report.format_report(eq, sp))
    fw = {n: tr for rs in results for n, tr in min(rs, key=lambda r: r["rank"])[
        "frameworks"].items()}
    return {"metrics": {"table": pp["table"], "model": cfg.model.name,
                        "params": param_count(cfg.model), "optimizer": spec.optimizer,
                        "process_sets": [list(s) for s in sets],
                        "patches_torch": {n: PATCHES_TORCH[n] for n in fw if n in PATCHES_TORCH},
                        "loadavg_1min": load, "repeats": repeats,
                        "equivalence": eq, "speed": sp,
                        "live_peak": {n: [r["frameworks"][n]["live_peak"] for rs in results
                                          for r in sorted(rs, key=lambda r: r["rank"])
                                          if n in r["frameworks"]] for n in fw},
                        "build_s": {n: fw[n]["build_s"] for n in fw}},
            "memory": {n: {f"rank{r['rank']}": r["frameworks"][n]["memory"]
                           for rs in results for r in rs if n in r["frameworks"]} for n in fw},
            "comm": {n: fw[n]["comm"] for n in fw}}



"""The dry run's real counterpart: the same training steps on real tensors of an initialised
(gloo) process group, reported as the dry run reports them -- the memory ledgers (paper §5
Table 1: 2Ψ + 2Ψ + KΨ and their partitions) and the live bytes per category, so that
``tests/unit/test_dryrun.py`` and Table 1 check the simulation against a run; and the live peaks
counted once more by PyTorch's CPU allocator, not by the tracer the dry run shares
(``allocator_live_peaks``). The step is the dry run's own (``dryrun.one_step``, through the
runtime's ``Trainer``). Module-level functions, for ``launch.spawn``.
"""
from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf

from zero_repro import schema
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.train.trainer import Trainer
from zero_repro.scale.dryrun import snapshot as SN
from zero_repro.scale.dryrun.allocator_peak import AllocatorPeak
from zero_repro.scale.dryrun.dryrun import one_step
from zero_repro.scale.dryrun.stack import categories as K
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.dryrun.trace import live_peaks, without_teardown
from zero_repro.scale.dryrun.tracer import ALLOC


def real_ledgers(rank: int, world_size: int, cfg_dicts: list[dict], iterations: int = 2
                 ) -> list[dict]:
    """The real counterpart of ``dry_run`` on an initialised (gloo) process group: for each
    config, ``train.build.build`` + ``iterations`` steps on real tensors, then the same ledgers.
    Module level, for ``launch.spawn``. Returns [{"ledger", "model_state_bytes" (device),
    "host_model_state_bytes", "psi", "psi_padded", "transport"}, ...] (``transport``: the
    ``dry_run(transport_of=...)`` of its DP buckets)."""
    out = []
    for d in cfg_dicts:
        cfg = schema.to_config(d)
        # every stage is built at every N_d, DP 1 included (Table 1's first column): no warning
        trainer = Trainer(cfg, warn_dp1=False)
        for it in range(iterations):
            one_step(trainer, None, set(), cfg, it)
        ledger, strategy = trainer.memory_ledger(), trainer.strategy
        out.append({"ledger": ledger.as_dict(), "model_state_bytes": ledger.model_states(),
                    "host_model_state_bytes": ledger.host_model_states(),
                    "psi": sum(p.numel() for p in trainer.model.parameters()
                               if p.requires_grad),
                    "psi_padded": sum(g.partition.padded_numel for g in strategy.groups),
                    "transport": strategy.transport.name})
        trainer.close()
    return out


def real_live_peaks(rank: int, world_size: int, cfg_dicts: list[dict], iterations: int = 2
                    ) -> list[dict]:
    """The real counterpart of ``dry_run``'s live-byte accounting on an initialised (gloo)
    process group: for each config, ``real_trace``'s run. Module level, for ``launch.spawn``.
    Returns [{"by_iteration": {it: live peak bytes}, "categories": {cat: bytes at the last
    step's live peak}, "transport"}, ...]."""
    out = []
    for d in cfg_dicts:
        t = real_trace(schema.to_config(d), iterations)
        _peak, _by_phase, by_iter = live_peaks(t["events"])
        out.append({"by_iteration": by_iter, "transport": t["transport"],
                    "categories": last_step_peak_categories(t["events"], t["category_of"])})
    return out


def real_snapshots(rank: int, world_size: int, cfg_dicts: list[dict], iterations: int = 2
                   ) -> list[dict]:
    """Memory snapshots (``snapshot.from_events``) of real CPU runs on an initialised (gloo)
    group: the trace measured by ``real_trace`` (live storages: measured), its segments the
    caching-allocator model placing them (a CPU run has no caching allocator: simulated).
    Module level, for ``launch.spawn``; beside a dry run's snapshot of the same config."""
    out = []
    for d in cfg_dicts:
        t = real_trace(schema.to_config(d), iterations)
        meta = {"kind": "measured trace (CPU run, live storages); segments simulated",
                "transport": t["transport"]}
        out.append(SN.from_events(t["events"], t["category_of"], t["module_of"], rank=rank,
                                  meta=meta, source="CPU run"))
    return out


def real_trace(cfg, iterations: int = 2) -> dict:
    """``train.build.build`` + ``iterations`` steps of ``cfg`` on real CPU tensors of the
    initialised (gloo) group, under a ``CategoryTracer`` that polls every storage before every
    allocating op (``poll_all``: it misses no in-place resize, whoever makes it; no watch list,
    no meta kernels, no output cache, real collectives), categories and modules tagged as the
    dry run tags them. Returns {"events" (up to the last step's end), "category_of",
    "module_of", "transport"}."""
    tracer = K.CategoryTracer(on_meta=False, poll_all=True, real_data=True)
    with tracer:
        with tracer.category(S.FP16_PARAMS):
            trainer = Trainer(cfg, skeleton_scope=tracer.untracked)
        hooks = K.tag_model(tracer, trainer.model) + K.tag_modules(tracer, trainer.model)
        for it in range(iterations):
            one_step(trainer, tracer, set(), cfg, it)
            K.tag_strategy(tracer, trainer.strategy)
        for h in hooks:
            h.remove()
        transport = trainer.strategy.transport.name
        trainer.close()
        del trainer
    return {"events": without_teardown(tracer.events), "category_of": dict(tracer.category_of),
            "module_of": dict(tracer.module_of), "transport": transport}


def allocator_live_peaks(rank: int, world_size: int, cfg_dicts: list[dict],
                         iterations: int = 2) -> list[dict]:
    """``real_live_peaks``'s steps without any tracer, counted by PyTorch's CPU allocator
    (``allocator_peak``: independent of the tracer the dry run and ``real_live_peaks`` share).
    Module level, for ``launch.spawn``. Returns [{"by_iteration": {it: live peak bytes}},
    ...]: each step's peak, the build's survivors included (the build's own blocks are
    counted from the build on)."""
    out = []
    for d in cfg_dicts:
        cfg = schema.to_config(d)
        with AllocatorPeak() as counter:
            trainer = Trainer(cfg)
            for it in range(iterations):
                with counter.window(str(it)):
                    one_step(trainer, None, set(), cfg, it)
            trainer.close()
            del trainer
        out.append({"by_iteration": {it: counter.peaks[str(it)] for it in range(iterations)}})
    return out


def last_step_peak_categories(events, category_of: dict) -> dict:
    """Live bytes per category at the last training iteration's live peak."""
    last = max(e[4] for e in events if e[3] != "build")
    live = best = 0
    at = 0
    for i, (kind, _sid, nbytes, phase, it) in enumerate(events):
        live += nbytes if kind == ALLOC else -nbytes
        if phase != "build" and it == last and live > best:
            best, at = live, i + 1
    return K.live_by_category(events, category_of, at)


def ledgers_per_stage(cfg, stages) -> dict:
    """``real_ledgers`` of ``cfg`` at each ZeRO stage of ``stages`` (paper §5 Table 1's columns),
    on ``cfg.parallel.world_size`` gloo ranks spawned for it; rank 0's:
    {"stages", "runs" (one ``real_ledgers`` entry per stage), "n_d"}."""
    stages = list(stages)
    dicts = [OmegaConf.to_container(OmegaConf.structured(
        dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, stage=s)))) for s in stages]
    n_d = cfg.parallel.world_size
    return {"stages": stages, "runs": spawn(real_ledgers, n_d, dicts)[0], "n_d": n_d}


"""Step-time benchmark of the ZeRO-DP stages and A/B race of the schedule's overlap knobs (paper §5,
§7), measured on local gloo ranks.

``python -m zero_repro.lab.bench [--model tiny|<conf/model>] [--world 2] [--steps N]``: each stage
0-3 in turn (TP 1, no ZeRO-R) on the same model and tokens; prints the median step time after
warm-up per stage and its ratio to stage 0. Times are this machine's CPUs over gloo and say
nothing about GPU clusters.

``--ab KNOB [KNOB ...] [--model gpt_20m] [--steps 6] [--repeats 3]`` (``ab_main``): each knob of
``KNOBS`` (``overlap_param_gather`` stages 1-2, ``prefetch_next_step`` and ``keep_gathered_turn``
stage 3, ``all``) off (A) against on (B), on one strategy whose ``zero`` config is flipped
between steps, so A and B alternate (A B B A …) on one model, data stream and machine load; knobs
acting across the step boundary (``CROSS_STEP``) alternate in blocks of two steps and only the
second is timed. A step (``train.step.train_step``) takes the slowest rank's time; per repeat the
medians of A and B and their ratio B/A; printed: the median ratio over repeats with its min-max
spread. Invariant: the §7 volumes are equal either way and the knobs are bit-identical
(``tests/unit/test_zero_overlap.py``), so a ratio < 1 is time the overlap saved.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf

from zero_repro.config import (Config, ModelConfig, ParallelConfig, TrainConfig, ZeroConfig,
                               ZeroRConfig)
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.train.trainer import Trainer
from zero_repro.paths import conf_group_dir


def model_config(name: str) -> ModelConfig:
    if name == "tiny":
        return ModelConfig(n_layer=2, n_embd=64, n_head=4, seq_len=32, vocab_size=512,
                           vocab_pad_multiple=8)
    path = conf_group_dir("model") / f"{name}.yaml"
    if path.exists():
        raw = {k: v for k, v in OmegaConf.to_container(OmegaConf.load(path)).items()
               if k != "defaults"}
        return ModelConfig(**raw)
    if name == "gpt_20m":
        return ModelConfig(name="gpt_20m", n_layer=6, n_embd=512, n_head=8, seq_len=128,
                           vocab_size=50257)
    raise ValueError(f"--model {name!r}: use tiny or gpt_20m (or add conf/model/{name}.yaml)")


def _bench_worker(rank: int, world: int, mcfg: ModelConfig, steps: int, warmup: int,
                  micro: int, dtype: str) -> dict:
    out = {}
    for stage in range(4):
        trainer = Trainer(_config(mcfg, world, ZeroConfig(stage=stage, dtype=dtype), micro))
        model = trainer.model
        g = torch.Generator().manual_seed(rank)
        times, losses = [], []
        for step in range(warmup + steps):
            idx = torch.randint(0, mcfg.vocab_size, (micro, mcfg.seq_len), generator=g)
            t0 = time.perf_counter()
            step_losses: list[torch.Tensor] = []
            trainer.step([(idx, idx)], on_loss=step_losses.append)
            dt = time.perf_counter() - t0
            if step >= warmup:
                times.append(dt)
            losses.append(step_losses[0].item())
        out[stage] = {"median_s": statistics.median(times), "last_loss": losses[-1],
                      "psi": sum(p.numel() for p in model.parameters())}
        trainer.close()
    return out


def _config(mcfg: ModelConfig, world: int, zero: ZeroConfig, micro: int) -> Config:
    """The benchmark's run: ``mcfg`` at DP ``world``, ``zero``, a micro-batch, no ZeRO-R."""
    return Config(model=mcfg, parallel=ParallelConfig(world_size=world, tp=1), zero=zero,
                  train=TrainConfig(micro_batch_size=micro),
                  # ZeRO's recommended buffers (C_B, M_D): the strategy's own default
                  zero_r=ZeroRConfig(name="custom", constant_buffers=True,
                                     contiguous_memory=True))


KNOB_STAGES = {"overlap_param_gather": (1, 2), "prefetch_next_step": (3,),
               "keep_gathered_turn": (3,), "all": (1, 2, 3)}
KNOBS = ("overlap_param_gather", "prefetch_next_step", "keep_gathered_turn")


def _flip(zero: ZeroConfig, knob: str, on: bool) -> None:
    """Set ``knob`` (every knob for ``all``) on ``zero`` in place: the strategy and its stores
    hold this one config and read the knobs afresh every step."""
    for n in KNOBS if knob == "all" else (knob,):
        setattr(zero, n, on)


def _order(steps: int) -> list[bool]:
    """A B B A A B B A …: each variant equally often first and second of a pair."""
    return [(i % 4) in (1, 2) for i in range(2 * steps)]


# knobs whose effect crosses a step boundary: what step k starts (the next step's first
# gathers, the parameter all-gather) is paid in step k and saved in step k + 1
CROSS_STEP = {"overlap_param_gather", "prefetch_next_step", "all"}


def _schedule(steps: int, knob: str) -> list[tuple[bool, bool]]:
    """(variant, timed) per step. Within-step knobs: A B B A …, every step timed. Cross-step
    knobs: the same order in blocks of two steps, only the second timed, so every timed step
    follows a step of its own variant (per-step alternation would credit a B step's prefetch
    to the A step after it)."""
    if knob not in CROSS_STEP:
        return [(on, True) for on in _order(steps)]
    return [(on, timed) for on in _order(steps) for timed in (False, True)]


def _ab_worker(rank: int, world: int, mcfg: ModelConfig, cases: list[tuple[int, str]],
               steps: int, warmup: int, repeats: int, micro: int, dtype: str) -> dict:
    out = {}
    for stage, knob in cases:
        trainer = Trainer(_config(mcfg, world, ZeroConfig(stage=stage, dtype=dtype), micro))
        strat = trainer.strategy
        g = torch.Generator().manual_seed(rank)

        def one_step(on: bool) -> float:
            _flip(strat.zero, knob, on)
            idx = torch.randint(0, mcfg.vocab_size, (micro, mcfg.seq_len), generator=g)
            t0 = time.perf_counter()
            trainer.step([(idx, idx)])
            return time.perf_counter() - t0

        for i in range(warmup):
            one_step(i % 2 == 1)
        reps = []
        for _ in range(repeats):
            times: dict[bool, list[float]] = {False: [], True: []}
            for on, timed in _schedule(steps, knob):
                t = one_step(on)
                if timed:
                    times[on].append(t)
            reps.append(times)
        out[(stage, knob)] = reps
        trainer.close()
    return out


def summarize(results: list[dict], cases: list[tuple[int, str]]) -> list[dict]:
    """Per case: per-repeat medians (slowest rank per step) and B/A ratios."""
    rows = []
    for case in cases:
        per_rank = [r[case] for r in results]
        meds = []
        for k in range(len(per_rank[0])):
            step_t = {on: [max(r[k][on][j] for r in per_rank)
                           for j in range(len(per_rank[0][k][on]))] for on in (False, True)}
            meds.append((statistics.median(step_t[False]), statistics.median(step_t[True])))
        ratios = [b / a for a, b in meds]
        rows.append({"stage": case[0], "knob": case[1], "a_ms": [a * 1e3 for a, _ in meds],
                     "b_ms": [b * 1e3 for _, b in meds], "ratios": ratios,
                     "ratio": statistics.median(ratios)})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--ab", nargs="+", choices=list(KNOB_STAGES),
                    help="A/B race of overlap knobs instead of the stage table")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], help="with --ab")
    ap.add_argument("--repeats", type=int, default=3, help="with --ab")
    a = ap.parse_args(argv)
    mcfg = model_config(a.model)
    if a.ab:
        return ab_main(a, mcfg)
    res = spawn(_bench_worker, a.world, mcfg, a.steps, a.warmup, a.micro, a.dtype)
    # a step ends when the slowest rank ends: take the max over ranks of each stage's median
    med = {s: max(r[s]["median_s"] for r in res) for s in range(4)}
    psi = res[0][0]["psi"]
    print(f"measured on local CPU ranks (gloo): model={a.model} Ψ={psi:,} world={a.world} "
          f"micro_batch={a.micro} dtype={a.dtype} steps={a.steps} (+{a.warmup} warm-up)")
    print(f"{'stage':>5} {'median step (ms)':>17} {'ratio to stage 0':>17} {'last loss':>10}")
    for s in range(4):
        print(f"{s:>5} {med[s] * 1e3:>17.1f} {med[s] / med[0]:>17.2f} "
              f"{res[0][s]['last_loss']:>10.4f}")


def ab_main(a: argparse.Namespace, mcfg: ModelConfig) -> None:
    """The --ab race: interleaved medians and B/A ratios per (stage, knob)."""
    cases = [(s, k) for k in a.ab for s in KNOB_STAGES[k] if s in a.stages]
    res = spawn(_ab_worker, a.world, mcfg, cases, a.steps, a.warmup, a.repeats, a.micro,
                a.dtype)
    print(f"measured on local CPU ranks (gloo), interleaved A/B: model={a.model} "
          f"world={a.world} micro_batch={a.micro} dtype={a.dtype} {a.steps} steps per variant "
          f"x {a.repeats} repeats (+{a.warmup} warm-up); A = knob off, B = knob on")
    print(f"{'stage':>5} {'knob':>21} {'A medians ms':>22} {'B medians ms':>22} "
          f"{'B/A median':>10} {'B/A spread':>13}")
    for r in summarize(res, cases):
        rng = lambda xs: f"{min(xs):.0f}-{max(xs):.0f}"  # noqa: E731
        print(f"{r['stage']:>5} {r['knob']:>21} {rng(r['a_ms']):>22} {rng(r['b_ms']):>22} "
              f"{r['ratio']:>10.3f} {min(r['ratios']):>6.3f}-{max(r['ratios']):.3f}")


if __name__ == "__main__":
    main()

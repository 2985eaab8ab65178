"""``python -m zero_repro.lab.estimate_breakdown --out results/estimate``: where the estimate's
step time goes (simulated: the time models only, no dry run), for five model sizes on A100 and
H100 (the modern stack, ``scale.modern_step``) and on the V100 2020 stack (``--time-model
paper2020``, ``scale.estimate_time``): compute, exposed communication, the compute slowed by
the communication it hides (``scale.overlap``) and host work, with a band; and each switch's
effect on the estimate's committed examples (``results/estimate/notes_modern_time.md``).

Writes ``breakdown.csv`` (one row per configuration and part) and ``breakdown.md`` (the
tables) and ``breakdown.png|pdf`` (stacked bars) into ``--out``.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import os

from zero_repro import config as C
from zero_repro import schema, validation
from zero_repro.scale import calibrate
from zero_repro.scale import estimate as E
from zero_repro.scale import estimate_time as T
from zero_repro.scale.paper.clusters import load_cluster

PARTS = ("compute", "exposed_comm", "overlap_slowdown", "host")
_COMM = ("tp_comm", "dp_exposed", "pa_comm", "cpu_offload", "pcie_exposed")
# five sizes, the modern stack: Llama 2 7B / 13B / 70B as released, Code Llama 34B's shape,
# a GPT-3 175B shape in Llama form (96 x 12288, 96 heads / 8 kv)
SHAPES = {"34b": dict(n_layer=48, n_embd=8192, n_head=64, n_kv_head=8, ffn_hidden=22016),
          "175b": dict(n_layer=96, n_embd=12288, n_head=96, n_kv_head=8, ffn_hidden=49152)}
MODERN_MODELS = ("llama2_7b", "llama2_13b", "34b", "llama2_70b", "175b")
MODERN_CLUSTERS = ("dgx_a100_80g", "h100")
# the 2020 stack: the paper's GPT shapes on DGX-2 nodes, stage 2, MP 1 for 1.5B, else 8-16
PAPER_MODELS = (("gpt_1p5b_48x1600", 1), ("gpt_8b", 8), ("gpt_13b", 16),
                ("gpt_40b_50x8192", 16), ("gpt_100b", 16))
EXAMPLES = (("llama2_7b", "l40s_pcie", 8, 1, (0, 1, 2, 3)),
            ("llama3_70b", "h100", 64, 8, (0, 1, 2, 3)),
            ("llama3_70b", "h100", 64, 1, (1, 2, 3)))


def model(name: str) -> C.ModelConfig:
    if name in SHAPES:
        return C.ModelConfig(name=name, family="llama", bias=False, seq_len=4096,
                             vocab_size=32000, **SHAPES[name])
    if name not in schema_models():
        raise ValueError(f"model {name!r}: none of conf/model")
    return C.ModelConfig(**schema.model_conf(name))


def schema_models() -> set:
    here = os.path.join(os.path.dirname(__file__), "..", "..", "conf", "model")
    return {f[:-5] for f in os.listdir(here) if f.endswith(".yaml")}


def config(name: str, cluster: str, gpus: int, tp: int, stage: int, batch: int,
           dtype: str = "bf16", offload: str = "none") -> C.Config:
    cfg = C.Config(model=model(name), parallel=C.ParallelConfig(world_size=gpus, tp=tp),
                   cluster=load_cluster(cluster))
    cfg.zero = dataclasses.replace(cfg.zero, dtype=dtype, reduce_bucket_size=E.BUCKET,
                                   allgather_bucket_size=E.BUCKET)
    cfg = validation.validate(cfg)
    return E.stage_config(cfg, stage, E.zero_r_name("auto", tp), batch, offload)


def split(p: dict) -> dict:
    """The step's parts (``PARTS``, seconds) of one ``estimate_time.performance`` result."""
    if p["model"] == "modern":
        t = p["terms"]
        comm = sum(t[k] for k in _COMM)
        return {"compute": p["compute_s"], "exposed_comm": comm,
                "overlap_slowdown": t["overlap_slowdown"], "host": t["host_adam"]}
    return {"compute": p["compute_s"],
            "exposed_comm": p["tp_s"] + p["dp_s"] + p["pa_s"] + p["offload_s"] + p["pcie_s"],
            "overlap_slowdown": p["overlap_slowdown_s"], "host": p["host_s"]}


def row(label: str, cfg: C.Config, timing: T.Timing) -> dict:
    hw = T.hardware_for(cfg)
    p = T.performance(cfg, hw, None, timing)
    parts = split(p)
    if p["model"] == "modern":
        lo, hi = p["step_s_band"]
    else:  # no kernel band: the Fig 2 fit's in-sample residuals (``fit_band``)
        lo, hi = (p["step_s"] * (1.0 + r) for r in fit_band())
    return {"label": label, "model": cfg.model.name, "cluster": cfg.cluster.name,
            "gpus": cfg.parallel.world_size, "tp": cfg.parallel.tp, "stage": cfg.zero.stage,
            "batch": cfg.train.micro_batch_size, "seq": cfg.model.seq_len,
            "time_model": p["model"], "step_s": p["step_s"], "band_fast_s": lo,
            "band_slow_s": hi, "mfu": p["mfu"], **parts}


def fit_band() -> tuple[float, float]:
    """(smallest, largest) relative error sim/paper - 1 of the paper2020 model's TFLOPs on the
    points it was fitted to (Fig 2's ZeRO series, ``calibrate.calibration``): a step of the
    calibrated model is the paper's within step·(1 + r) over that range."""
    rel = [r["rel_err"] for r in calibrate.calibration().residuals]
    return min(rel), max(rel)


def breakdown() -> list[dict]:
    """Every row of the breakdown (module doc): 64 GPUs, stage 3, micro-batch 1 x 4096 on
    A100 / H100; 400 V100s (64 for 1.5B), stage 2, micro-batch 4 x 1024 for the 2020 stack;
    and one node of each with the optimizer on the host (stage 2)."""
    rows = []
    for cl in MODERN_CLUSTERS:
        for name in MODERN_MODELS:
            rows.append(row("modern", config(name, cl, 64, 1, 3, 1), T.Timing()))
    for name, mp in PAPER_MODELS:
        gpus = 64 if mp == 1 else 400
        cfg = config(name, "dgx2_v100", gpus, mp, 2, 4, dtype="fp16")
        rows.append(row("2020 stack", cfg, T.Timing(model="paper2020")))
    # host work: ZeRO-Offload (the optimizer on the host) on one node of each
    rows.append(row("modern + offload", config("llama2_13b", "h100", 8, 1, 2, 1,
                                               offload="cpu"), T.Timing()))
    rows.append(row("2020 stack + offload", config("gpt_8b", "dgx2_v100", 16, 1, 2, 4,
                                                   dtype="fp16", offload="cpu"),
                    T.Timing(model="paper2020")))
    return rows


def switch_effects() -> list[dict]:
    """Step time of the committed examples with every switch on, and with each one off."""
    out = []
    variants = {"all on": T.Timing(), "collectives=ring": T.Timing(collectives="ring"),
                "no overlap slowdown": T.Timing(overlap_slowdown=False),
                "both off (before)": T.Timing(collectives="ring", overlap_slowdown=False)}
    for name, cl, gpus, tp, stages in EXAMPLES:
        for s in stages:
            cfg = config(name, cl, gpus, tp, s, 1)
            hw = T.hardware_for(cfg)
            r = {"model": name, "cluster": cl, "gpus": gpus, "tp": tp, "stage": s}
            for k, tm in variants.items():
                r[k] = T.performance(cfg, hw, None, tm)["step_s"]
            out.append(r)
    return out


def write(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    rows, eff = breakdown(), switch_effects()
    with open(os.path.join(out, "breakdown.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    with open(os.path.join(out, "breakdown.md"), "w") as f:
        f.write(markdown(rows, eff))
    plot(rows, out)


def markdown(rows: list, eff: list) -> str:
    head = ("| stack | model | cluster | GPUs | TP | stage | batch x seq | step (s) | band (s) | "
            "compute | exposed comm. | overlap slowdown | host | MFU |\n" + "|---" * 14 + "|\n")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['label']} | {r['model']} | {r['cluster']} | {r['gpus']} | {r['tp']} "
                     f"| {r['stage']} | {r['batch']} x {r['seq']} | {r['step_s']:.3f} | "
                     f"{r['band_fast_s']:.3f}-{r['band_slow_s']:.3f} | "
                     + " | ".join(f"{r[k]:.3f} ({r[k] / r['step_s']:.0%})" for k in PARTS)
                     + f" | {r['mfu']:.1%} |\n")
    keys = [k for k in eff[0] if k not in ("model", "cluster", "gpus", "tp", "stage")]
    lines.append("\n| model | cluster | GPUs | TP | stage | " + " | ".join(keys) + " |\n"
                 + "|---" * (5 + len(keys)) + "|\n")
    for r in eff:
        lines.append(f"| {r['model']} | {r['cluster']} | {r['gpus']} | {r['tp']} | {r['stage']} | "
                     + " | ".join(f"{r[k]:.3f}" for k in keys) + " |\n")
    return "".join(lines)


def plot(rows: list, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(14, 5))
    names = [f"{r['model']}\n{r['cluster']}" + ("\n+ offload" if "offload" in r["label"] else "")
             for r in rows]
    bottom = [0.0] * len(rows)
    colors = {"compute": "#4C72B0", "exposed_comm": "#DD8452", "overlap_slowdown": "#C44E52",
              "host": "#55A868"}
    labels = {"compute": "compute", "exposed_comm": "exposed communication",
              "overlap_slowdown": "compute slowed by hidden communication",
              "host": "host work (offload)"}
    for k in PARTS:
        frac = [r[k] / r["step_s"] for r in rows]
        ax.bar(range(len(rows)), frac, bottom=bottom, color=colors[k], label=labels[k])
        bottom = [b + f for b, f in zip(bottom, frac)]
    for i, r in enumerate(rows):
        ax.text(i, 1.01, f"{r['step_s']:.2g} s", ha="center", fontsize=7)
    ax.set_xticks(range(len(rows)), names, rotation=90, fontsize=7)
    ax.set_ylabel("fraction of the step time")
    ax.set_ylim(0, 1.1)
    ax.set_title("Where the estimate's step time goes (simulated; A100 / H100: modern stack, "
                 "stage 3, 64 GPUs;\nDGX-2 V100: 2020 stack, stage 2; + offload: one node, "
                 "stage 2, the optimizer on the host)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(os.path.join(out, f"breakdown.{ext}"), dpi=120, bbox_inches="tight",
                    metadata={"CreationDate": None} if ext == "pdf" else {"Software": None})
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zero_repro.lab.estimate_breakdown")
    ap.add_argument("--out", default="results/estimate")
    write(ap.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

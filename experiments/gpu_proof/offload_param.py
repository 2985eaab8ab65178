"""The GPU proof's parameter-offload part (``zero_offload_param``; ``experiments/gpu_proof``
plans it with the others): one GPU trains a model whose fp16 parameters alone do not fit the
memory it is given, with ZeRO-3 Offload (``zero.offload_param=cpu`` with
``zero.offload_optimizer=cpu``; DeepSpeed's ``offload_param``, ZeRO-Infinity's CPU tier).

Stage 3 at world 1, C_B + M_D, ``dtype``, the same seeds and batches:

1. reference: the optimizer offloaded, the parameters on the device, the whole GPU;
2. the process's device memory capped at ``cap_gb`` (``torch.cuda.set_per_process_memory_fraction``)
   below the model's lp parameters (lp·Ψ): the same run with the optimizer offloaded alone must
   run out of memory (``torch.cuda.OutOfMemoryError``);
3. under the same cap with the parameters offloaded too: it trains.

Checks: 2 ran out of memory and 3 did not; 3's peak allocated stays under the cap and below
lp·Ψ; 3's fp32 parameters equal 1's within ``param_atol`` (the same kernels on the same values:
the host copies move bytes, not arithmetic); the ledger's device model states are 0 and its host
ones Table 1's offload column with the parameters (``table1.offload_bytes``).

``device: cpu`` (the CI dry path): tiny sizes on one gloo rank, no cap (host and device are the
same memory): the equivalence and the ledger only.
"""
from __future__ import annotations

import torch

from experiments.gpu_proof.offload import _device, _one
from zero_repro.lab.points import Point
from zero_repro.scale.paper.table1 import offload_bytes

PART = "zero_offload_param"
LP = {"fp32": 4, "bf16": 2, "fp16": 2}


def points(p, cuda: bool, base: dict, tag: dict, model_overrides) -> list[Point]:
    """The part's one point (``experiment.params.zero_offload_param``)."""
    z = dict(p.get(PART) or {})
    if not z:
        return []
    return [Point(name="zero_offload_param stage 3", params={
        "part": PART, **tag, "steps": int(z.get("steps", 3) if cuda else 2),
        "dtype": str(z.get("dtype", "bf16")), "cap_gb": float(z.get("cap_gb", 4.0)),
        "param_atol": float(z.get("param_atol", 1e-5)),
        "bucket": int(z.get("bucket", 50_000_000) if cuda else 6000)},
        overrides={**base, **model_overrides(z.get("model" if cuda else "cpu_model", "tiny")),
                   "train.micro_batch_size": int(z.get("batch", 1) if cuda else 2)})]


def estimate_s(q: dict, psi: float, compute: float, spawn_s: float, init_per_s: float
               ) -> float:
    """Seconds on a GPU: three builds, two runs of ``steps`` steps (a host step of Ψ at ~1 G
    elements/s per core over 16 cores, 3·lp·Ψ over ~20 GB/s of PCIe each), one failed run."""
    step = compute + psi / 16e9 + 3 * LP[q["dtype"]] * psi / 20e9
    return spawn_s + 3 * psi / init_per_s + (2 * q["steps"] + 1) * step + 10


def zero_offload_param_rank(rank: int, world: int, cfg, q: dict) -> dict:
    """One rank: the three runs of the module docstring, in that order (the cap last)."""
    device = _device(q["device"])
    cuda = device.type == "cuda"
    run = dict(q, dtypes=[q["dtype"]])
    ref = _one(cfg, run, device, q["dtype"], "cpu", stage=3)
    out = {"cap_bytes": None, "without_param_oom": None, "oom_message": ""}
    if cuda:
        cap = q["cap_gb"] * 1e9
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(
            cap / torch.cuda.get_device_properties(device).total_memory, device)
        out["cap_bytes"] = cap
        try:
            _one(cfg, run, device, q["dtype"], "cpu", stage=3)
            out["without_param_oom"] = False
        except torch.cuda.OutOfMemoryError as e:
            out["without_param_oom"] = True
            out["oom_message"] = str(e).splitlines()[0][:300]
        torch.cuda.empty_cache()
    got = _one(cfg, run, device, q["dtype"], "cpu", stage=3, param="cpu")
    psi = got["psi_padded"]
    want = offload_bytes(psi, 3, 1, lp_bytes=LP[q["dtype"]], param="cpu")
    out.update({
        "max_abs_param_diff": max(float((ref["theta"][n] - got["theta"][n]).abs().max())
                                  for n in ref["theta"]),
        "peak_allocated": got["peak_allocated"], "lp_param_bytes": LP[q["dtype"]] * psi,
        "ledger_device": got["device_model_states"], "ledger_host": got["host_model_states"],
        "formula_device": want["device"], "formula_host": want["host"],
        "step_s_param_offload": got["step_s"], "step_s_reference": ref["step_s"],
        "psi_padded": psi})
    return out


def checks(q: dict, m: dict) -> dict:
    """Pass/fail of the part (module docstring)."""
    out = {"parameters": m["max_abs_param_diff"] <= q["param_atol"],
           "ledger": (m["ledger_device"] == m["formula_device"] == 0
                      and m["ledger_host"] == m["formula_host"])}
    if q["device"] == "cuda":
        out["without_param_offload_oom"] = bool(m["without_param_oom"])
        out["peak_under_cap"] = m["peak_allocated"] <= m["cap_bytes"]
        out["cap_below_lp_params"] = m["cap_bytes"] < m["lp_param_bytes"]
    return out


def rows(m: dict) -> list[tuple[str, str, float, str]]:
    """(x, y_name, value, unit) rows for the proof's table."""
    out = [("stage 3", "max_abs_param_diff", m["max_abs_param_diff"], "abs"),
           ("stage 3", "lp_param_GB", m["lp_param_bytes"] / 1e9, "GB"),
           ("stage 3", "step_s_param_offload", m["step_s_param_offload"], "s")]
    if m.get("cap_bytes"):
        out += [("stage 3", "cap_GB", m["cap_bytes"] / 1e9, "GB"),
                ("stage 3", "peak_GB_param_offload", m["peak_allocated"] / 1e9, "GB")]
    return out

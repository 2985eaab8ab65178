"""A real CUDA rank's peak device memory beside the dry run's prediction, by category (paper
§10.5: the memory a rank of the paper's runs holds; what the dry run of ``scale.dryrun`` predicts).

Both sides are split the same way, in bytes:

    held      = model states + comm buffers + gathered parameters + checkpoints on the device
                (the runtime's ledger: the exact sizes of its own tensors, alike on both sides)
    working   = peak requested - held          activations, logits, attention state, temporaries,
                                               library workspaces
    rounding  = peak allocated - peak requested   the caching allocator's block rounding
    cached    = peak reserved - peak allocated    freed blocks the allocator keeps

so peak allocated = held + working + rounding and peak reserved = that + cached. Measured:
``torch.cuda.memory_stats`` after the training iterations, peaks since the reset after the build
(``requested_bytes.all.peak``, ``allocated_bytes.all.peak``, ``reserved_bytes.all.peak``; each
the allocator's own high-water mark); predicted: the dry run's allocator replay
(``peak_requested``, ``peak_allocated``, ``peak_reserved``, the same three marks). ``miss`` names
the category that differs most when the measured / predicted peak-allocated ratio leaves its
band, with the reasons known to make that category differ (``KNOWN``).
"""
from __future__ import annotations

import torch

from zero_repro.runtime.zero.ledger import MODEL_STATE_CATEGORIES

CATEGORIES = ("model_states", "comm_buffers", "params_gathered", "checkpoints", "working",
              "rounding", "cached_free")
# what makes the allocated peak (not the reserved one)
ALLOCATED = CATEGORIES[:-1]
STATS = ("requested_bytes.all.peak", "allocated_bytes.all.peak", "reserved_bytes.all.peak",
         "allocated_bytes.large_pool.peak", "allocated_bytes.small_pool.peak",
         "inactive_split_bytes.all.peak", "num_alloc_retries", "num_ooms")
EXACT = ("the same runtime tensors on both sides, exact in the ledger: a difference is a bug of "
         "the runtime or the dry run")
KNOWN = {
    "model_states": EXACT, "comm_buffers": EXACT, "params_gathered": EXACT, "checkpoints": EXACT,
    "working": "the dry run models memory-efficient attention where an H100 in fp16/bf16 runs "
               "flash attention (other saved softmax state and scratch); cuBLAS/cuBLASLt "
               "workspaces, allocated through the caching allocator per handle and stream, are "
               "not modelled; with P_a+cpu (C5) the prefetched checkpoints are allocated on "
               "the side stream",
    "rounding": "the allocator model's rounding (512 B blocks, 2 MiB small-pool segments, "
                "splitting of large blocks) against the real allocator's",
    "cached_free": "blocks freed on P_a+cpu's side stream stay in that stream's pool (C5): the "
                   "allocator model has one stream",
}


def memory_stats(device: torch.device) -> dict[str, int]:
    """The ``STATS`` subset of ``torch.cuda.memory_stats`` (0 for a key this torch lacks)."""
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in STATS}


def held(ledger: dict[str, int], cpu_checkpoints: bool) -> dict[str, int]:
    """The runtime's own device bytes by category, from a ``MemoryLedger.as_dict()`` (the
    checkpoints: the device M_D arena when there is one, else the kept checkpoints' peak; none
    with P_a+cpu, whose checkpoints live in host memory)."""
    ckpt = 0 if cpu_checkpoints else (ledger.get("arena_capacity", 0)
                                      or ledger.get("ckpt_device", 0))
    return {"model_states": sum(ledger.get(c, 0) for c in MODEL_STATE_CATEGORIES),
            "comm_buffers": ledger.get("comm_buffers", 0),
            "params_gathered": ledger.get("params_gathered", 0), "checkpoints": ckpt}


def by_category(ledger: dict[str, int], requested: int | None, allocated: int | None,
                reserved: int | None, cpu_checkpoints: bool) -> dict[str, int | None]:
    """``CATEGORIES`` -> bytes (module docstring); the allocator's terms None when its peaks
    are unknown (a CPU run)."""
    out: dict[str, int | None] = dict(held(ledger, cpu_checkpoints))
    if requested is None or allocated is None or reserved is None:
        return {**out, "working": None, "rounding": None, "cached_free": None}
    out.update(working=requested - sum(out.values()), rounding=allocated - requested,
               cached_free=reserved - allocated)
    return out


def measured(ledger: dict[str, int], stats: dict[str, int] | None,
             cpu_checkpoints: bool) -> dict[str, int | None]:
    """A real rank's categories from its ledger and ``memory_stats`` (None: not on CUDA)."""
    s = stats or {}
    return by_category(ledger, s.get("requested_bytes.all.peak"),
                       s.get("allocated_bytes.all.peak"), s.get("reserved_bytes.all.peak"),
                       cpu_checkpoints)


def predicted(ledger: dict[str, int], allocator: dict,
              cpu_checkpoints: bool) -> dict[str, int | None]:
    """The dry run's categories from its ledger and allocator replay (``DryRunResult``)."""
    return by_category(ledger, allocator.get("peak_requested"), allocator.get("peak_allocated"),
                       allocator.get("peak_reserved"), cpu_checkpoints)


def miss(real: dict, pred: dict, ratio: float | None, band: tuple[float, float]) -> str:
    """'' when the measured / predicted peak-allocated ``ratio`` is inside ``band`` (or
    unknown); else one sentence: the ratio, the category of ``ALLOCATED`` whose bytes differ
    most (measured - predicted) and its known reasons."""
    lo, hi = band
    if ratio is None or lo <= ratio <= hi:
        return ""
    deltas = {c: real[c] - pred[c] for c in ALLOCATED
              if real.get(c) is not None and pred.get(c) is not None}
    worst = max(deltas, key=lambda c: abs(deltas[c]))
    return (f"peak allocated {ratio:.3f}x the dry run's, outside [{lo}, {hi}]: {worst} differs "
            f"most ({deltas[worst] / 1e9:+.2f} GB measured - dry run); known reasons: "
            f"{KNOWN[worst]}")


def table(real: dict, pred: dict) -> list[str]:
    """Markdown rows: category | measured GB | dry run GB | measured - dry run GB."""
    rows = ["| category | measured GB | dry run GB | measured - dry run GB |",
            "|---|---|---|---|"]
    for c in CATEGORIES:
        m, p = real.get(c), pred.get(c)
        diff = "" if m is None or p is None else f"{(m - p) / 1e9:+.3f}"
        rows.append(f"| {c} | {'-' if m is None else f'{m / 1e9:.3f}'} | "
                    f"{'-' if p is None else f'{p / 1e9:.3f}'} | {diff} |")
    return rows

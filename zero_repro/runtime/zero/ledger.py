"""Memory ledger (``MemoryLedger``): bytes owned per category on this rank (paper §3.1 model states,
§6 residual states); pure bookkeeping, reading it has no side effects.

Model-state categories (``MODEL_STATE_CATEGORIES``; Table 1, mixed-precision Adam: 2Ψ + 2Ψ + 12Ψ
= 16Ψ bytes for baseline DP, divided by N_d where a stage partitions them): ``params_lp``
(fp16/bf16 parameters; fp32 in fp32 mode), ``grads`` (persistent gradient storage; stages 2-3:
the shard), ``master_fp32`` (0 in fp32 mode: the parameters are the master), ``adam_m``,
``adam_v``. Others: ``comm_buffers`` (the fused gradient buffers allocated and the transport's own),
``params_gathered`` (stage 3's gathered units, peak) and what other modules add (ZeRO-R:
``ckpt_device``, ``ckpt_cpu``, ``arena_capacity``, ``arena_used``, ``fused_buffers``).
"""
from __future__ import annotations

from collections import OrderedDict

MODEL_STATE_CATEGORIES = ("params_lp", "grads", "master_fp32", "adam_m", "adam_v")


class MemoryLedger:
    """Bytes per category. ``add`` accumulates; categories are open-ended strings."""

    def __init__(self) -> None:
        self._bytes: "OrderedDict[str, int]" = OrderedDict(
            (c, 0) for c in MODEL_STATE_CATEGORIES + ("comm_buffers",))

    def add(self, category: str, nbytes: int) -> "MemoryLedger":
        self._bytes[category] = self._bytes.get(category, 0) + int(nbytes)
        return self

    def get(self, category: str) -> int:
        return self._bytes.get(category, 0)

    def as_dict(self) -> dict[str, int]:
        return dict(self._bytes)

    def total(self) -> int:
        return sum(self._bytes.values())

    def model_states(self) -> int:
        """Bytes of the Table 1 model states (params, grads, optimizer states)."""
        return sum(self._bytes.get(c, 0) for c in MODEL_STATE_CATEGORIES)

    def merge(self, other: "MemoryLedger") -> "MemoryLedger":
        for k, v in other.as_dict().items():
            self.add(k, v)
        return self

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v}" for k, v in self._bytes.items())
        return f"MemoryLedger({body})"


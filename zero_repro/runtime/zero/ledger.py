"""Memory ledger (``MemoryLedger``): bytes owned per category on this rank (paper §3.1 model states,
§6 residual states); pure bookkeeping, reading it has no side effects.

Model-state categories (``MODEL_STATE_CATEGORIES``; Table 1, mixed-precision Adam: 2Ψ + 2Ψ + 12Ψ
= 16Ψ bytes for baseline DP, divided by N_d where a stage partitions them): ``params_lp``
(fp16/bf16 parameters; fp32 in fp32 mode), ``grads`` (persistent gradient storage; stages 2-3:
the shard), ``master_fp32`` (0 in fp32 mode: the parameters are the master), ``adam_m``,
``adam_v``. Others: ``comm_buffers`` (the fused gradient buffers allocated and the transport's own),
``params_gathered`` (stage 3's gathered units, peak) and what other modules add (ZeRO-R:
``ckpt_device``, ``ckpt_cpu``, ``arena_capacity``, ``arena_used``, ``fused_buffers``).

Host and device apart: a category held in host memory ends in ``_host`` (ZeRO-Offload,
``zero.offload``: ``master_fp32_host``, ``adam_m_host``, ``adam_v_host``, ``grads_host``, the
step's ``optim_step_host``; ``zero.offload_param``: ``params_lp_host``, ``params_frozen_host``)
or is P_a+cpu's ``ckpt_cpu``; every other category is device memory. ``model_states()`` /
``device_total()`` count the device, ``host_model_states()`` / ``host_total()`` the host; with
optimizer offload at stage 2 (fp16) the device holds 2Ψ of model states and the host 14Ψ/N_d
(``scale.paper.table1.offload_bytes``).
"""
from __future__ import annotations

from collections import OrderedDict

MODEL_STATE_CATEGORIES = ("params_lp", "grads", "master_fp32", "adam_m", "adam_v")
HOST = "_host"  # the suffix of a category held in host memory
HOST_MODEL_STATE_CATEGORIES = tuple(c + HOST for c in MODEL_STATE_CATEGORIES)
HOST_CATEGORIES = frozenset(("ckpt_cpu",))  # host categories named before the suffix


def is_host(category: str) -> bool:
    """Whether ``category`` is held in host memory (module docstring)."""
    return category.endswith(HOST) or category in HOST_CATEGORIES


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
        """Every category, host and device."""
        return sum(self._bytes.values())

    def device_total(self) -> int:
        return sum(v for k, v in self._bytes.items() if not is_host(k))

    def host_total(self) -> int:
        return sum(v for k, v in self._bytes.items() if is_host(k))

    def model_states(self) -> int:
        """Device bytes of the Table 1 model states (params, grads, optimizer states)."""
        return sum(self._bytes.get(c, 0) for c in MODEL_STATE_CATEGORIES)

    def host_model_states(self) -> int:
        """Host bytes of the model states (ZeRO-Offload: master, m, v, the gradient copy)."""
        return sum(self._bytes.get(c, 0) for c in HOST_MODEL_STATE_CATEGORIES)

    def merge(self, other: "MemoryLedger") -> "MemoryLedger":
        for k, v in other.as_dict().items():
            self.add(k, v)
        return self

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v}" for k, v in self._bytes.items())
        return f"MemoryLedger({body})"

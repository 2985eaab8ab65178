"""Each GPU kind the project knows, in one home: one module per GPU in this package holds its
datasheet facts (dense bf16/fp16 tensor-core peak, memory bandwidth, SMs, memory as sold and as
the device reports it), its generation, the name CUDA reports for it, and its sourced
kernel-level points (GEMM, flash attention, streaming memory) from which the modern step model
(``zero_repro.scale.kernels``) is built. A cluster (``conf/cluster/<name>.yaml``) names its GPU
with ``gpu: <key>``; ``zero_repro.config.ClusterConfig`` takes the GPU's facts from here.

Adding a GPU kind: one module ``zero_repro/gpus/<key>.py`` defining ``GPU = Gpu(...)`` with its
sources in the module doc (a GPU of a generation not in ``GENERATIONS`` adds its row there).
Every module of the package that defines ``GPU`` is found (``known``); an unknown key is refused
naming the known ones (``gpu``).

The generation is a field of the GPU: which fused attention kernel class exists on it, which
NVLink table its collectives read and whether NCCL keeps NVLink SHARP buffers are the
generation's (``Generation``), never matched from a name.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from functools import lru_cache

KINDS = ("gemm", "attn_fwd", "attn_bwd", "attn_fwd_causal", "attn_bwd_causal", "hbm")


@dataclass(frozen=True)
class Generation:
    """What a GPU generation decides for the step model: ``flash`` the fused attention class
    (``fa1``: memory-efficient SDPA only, as on sm70; ``fa2``: FlashAttention-2; ``fa2_fa3``:
    FlashAttention-2 up to the FlashAttention-3 class, Hopper), ``nvlink`` the link table of
    ``zero_repro.scale.kernel_sources.LINK`` its NVLink collectives read, ``proxy`` the device whose
    published numbers stand in for its attention and NVLink efficiencies ("" when its own),
    ``nvls`` whether NCCL keeps NVLink SHARP buffers with more than 2 GPUs on NVSwitch."""
    name: str
    flash: str
    nvlink: str
    proxy: str = ""
    nvls: bool = False


GENERATIONS = {g.name: g for g in (
    Generation("volta", "fa1", "nvlink_ampere", proxy="a100"),
    Generation("ampere", "fa2", "nvlink_ampere"),
    Generation("ada", "fa2", "nvlink_ampere", proxy="a100"),
    Generation("hopper", "fa2_fa3", "nvlink_hopper", nvls=True),
)}


@dataclass(frozen=True)
class Point:
    """One kernel-level measurement of ``kind`` at ``shape``: ``value`` TFLOPS (GB/s for
    ``hbm``) from ``source``. ``measured_on`` names the board it was measured on when that is
    not the GPU itself, and ``ref`` that board's datasheet peak (TFLOPS) or bandwidth (GB/s),
    the efficiency's denominator (0: the GPU's own). ``check_only``: a shape-dependence check,
    not an input of the GPU's band."""
    kind: str
    shape: tuple
    value: float
    source: str
    measured_on: str = ""
    ref: float = 0.0
    check_only: bool = False
    kernel: str = ""  # attention: the kernel class measured, fa2 | fa3


@dataclass(frozen=True)
class Gpu:
    """One GPU kind (module doc). ``cuda_name``: (tokens all in the name
    ``torch.cuda.get_device_name`` reports, tokens none of which is in it)."""
    key: str
    name: str
    generation: str
    peak_tflops: float  # dense bf16/fp16 tensor-core peak, no sparsity
    hbm_gbps: float  # device memory bandwidth, GB/s
    sm_count: int
    memory_gb: float  # datasheet size, GB = 1e9 B
    memory_mib: float = 0.0  # total the device reports (nvidia-smi / NVML), MiB; 0 = unknown
    cuda_name: tuple = ((), ())
    nvlink: bool = True  # False: GPUs of a node talk over PCIe
    points: tuple = field(default=(), repr=False)

    def __post_init__(self):
        if self.generation not in GENERATIONS:
            raise ValueError(f"GPU {self.key!r}: generation {self.generation!r} is not one of "
                             f"{sorted(GENERATIONS)}; add its row to zero_repro.gpus.GENERATIONS")
        bad = [p for p in self.points if p.kind not in KINDS]
        if bad:
            raise ValueError(f"GPU {self.key!r}: point kinds {[p.kind for p in bad]} are not "
                             f"among {KINDS}")

    @property
    def gen(self) -> Generation:
        return GENERATIONS[self.generation]

    def of(self, kind: str) -> tuple:
        """Its points of ``kind``."""
        return tuple(p for p in self.points if p.kind == kind)

    def ref(self, p: Point) -> float:
        """The denominator of ``p``'s efficiency: the measured board's figure, else its own."""
        if p.ref:
            return p.ref
        return self.hbm_gbps if p.kind == "hbm" else self.peak_tflops


@lru_cache(maxsize=None)
def known() -> dict:
    """key -> Gpu of every module of this package that defines ``GPU``."""
    out = {}
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        g = getattr(importlib.import_module(f"{__name__}.{m.name}"), "GPU", None)
        if isinstance(g, Gpu):
            if g.key != m.name:
                raise ValueError(f"zero_repro/gpus/{m.name}.py defines GPU {g.key!r}: name the "
                                 f"module after its key")
            out[g.key] = g
    return out


def gpu(key: str) -> Gpu:
    """The GPU ``key``; ValueError naming the known ones otherwise."""
    g = known().get(key)
    if g is None:
        raise ValueError(f"unknown GPU {key!r}: use one of {sorted(known())}, or add "
                         f"zero_repro/gpus/{key}.py (zero_repro.gpus)")
    return g

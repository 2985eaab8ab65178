"""Bytes a training process of today's stack holds on the device outside PyTorch's caching
allocator (CUDA context, NCCL's buffers): they lower the capacity the estimate judges the
allocator's replay against (``scale.estimate``), as ``dryrun.stack.outside`` does for the paper's
2020 stack. A bracket [low, high] per device generation, each part sourced:

  * ``cuda_context`` -- driver state and the kernel images loaded so far; CUDA >= 11.7 loads
    modules lazily (PyTorch sets CUDA_MODULE_LOADING=LAZY since 1.13):
    low  274 MiB: pytorch/pytorch#86509 (cudaMemGetInfo after a first tensor: 287,047,680 B
         lazy, 666,632,192 B eager);
    high 426 MiB: unslothai/unsloth-zoo#1053 (nvidia-smi after torch.cuda.mem_get_info, torch
         2.10.0+cu130, RTX 6000 Ada). ptrblck in pytorch/pytorch#109888: "around 400MB".
  * ``nccl_buffers`` -- per connection NCCL allocates its protocols' FIFOs: LL 8 lines x 512
    threads x 8 steps x 16 B = 512 KiB, LL128 120 x 640 x 8 x 8 B = 4.69 MiB, Simple 4 MiB
    (NVIDIA/nccl@5067397c src/init.cc DEFAULT_*BUFFSIZE, src/include/device.h): 9.19 MiB.
    low  16 channels x 1 ring connection x the Simple FIFO only (lazily connected, one
         protocol) -- NVIDIA/nccl#892's log of 8 x H800: "16 coll channels";
    high 32 channels x (1 ring + 3 tree) connections x all three FIFOs, per communicator.
  * ``nvls`` (Hopper with more than 2 GPUs on NVSwitch: NVLink SHARP) -- 288 MiB per rank and
    communicator (vllm-project/vllm#9699's NCCL log: nvlsPerRankSize 301989888); 0 at low
    (NCCL_NVLS_ENABLE=0 is common: NVIDIA/NeMo-Framework-Launcher#127 "for memory saving").
Communicators: the DP group, + the TP group when TP > 1. A check: NVIDIA/nccl#864 measured
~1.6 GB for one communicator after an all-reduce, context included, ~6 GB for three or more.
"""
from __future__ import annotations

from zero_repro.gpus import Generation
from zero_repro.scale.dryrun.stack.outside import Part

MIB = 2**20
CONTEXT = (274 * MIB, 426 * MIB)
NCCL_FIFOS = 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8 + (1 << 22)  # LL + LL128 + Simple, bytes
NCCL_SIMPLE = 1 << 22
NCCL_LOW = 16 * 1 * NCCL_SIMPLE
NCCL_HIGH = 32 * (1 + 3) * NCCL_FIFOS
NVLS = 301_989_888


def parts(generation: Generation, communicators: int, gpus_per_node: int,
          nvlink: bool = True) -> tuple[Part, ...]:
    """The parts outside the allocator of one rank (module doc); NVLS where the generation
    keeps NVLink SHARP buffers (``Generation.nvls``) and the node's GPUs talk over NVLink
    (``nvlink``: a PCIe board has no NVSwitch to reduce on)."""
    n = max(1, communicators)
    out = [Part("cuda_context", CONTEXT[0], CONTEXT[1],
                "pytorch/pytorch#86509 (274 MiB lazy); unslothai/unsloth-zoo#1053 (426 MiB)"),
           Part("nccl_buffers", NCCL_LOW, n * NCCL_HIGH,
                "NVIDIA/nccl@5067397c init.cc/device.h FIFO sizes; 16-32 channels "
                "(NVIDIA/nccl#892); per communicator")]
    if generation.nvls and nvlink and gpus_per_node > 2:
        out.append(Part("nvls", 0, n * NVLS, "vllm-project/vllm#9699 (nvlsPerRankSize)"))
    return tuple(out)


def bracket(generation: Generation, communicators: int, gpus_per_node: int,
            nvlink: bool = True) -> dict:
    """{"low", "mid", "high"} bytes outside the allocator, and the parts (module doc)."""
    ps = parts(generation, communicators, gpus_per_node, nvlink)
    lo, hi = sum(p.low for p in ps), sum(p.high for p in ps)
    return {"low": lo, "mid": (lo + hi) // 2, "high": hi,
            "parts": {p.name: (p.low, p.high, p.source) for p in ps}}

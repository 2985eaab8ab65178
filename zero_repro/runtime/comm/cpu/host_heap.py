"""Host memory of CPU ranks: a caching malloc (tcmalloc), as the CUDA caching allocator is on GPU.

On GPU, PyTorch's caching allocator keeps every freed block and serves the next step's tensors
from it: a training step's steady state asks the driver for nothing. On CPU, PyTorch has no
cache: a tensor is ``posix_memalign``-ed from the C library and freed back to it. glibc serves a
request of more than 32 MiB (its largest ``mmap`` threshold) with a fresh ``mmap`` and returns
it with ``munmap`` on free, so every such tensor of every step is new memory that the kernel
faults in (and zeroes) 4 KiB at a time. GPT-20M (V = 50257, d = 512: the tied embedding, its
gradient, the logits and their gradient are 103 MB each) took 113k minor faults per step on each
rank, ~0.15 s of a 0.70 s step at world 2 (``resource.getrusage``), in every framework alike.

What was tried (world 2, GPT-20M, stage 0 / stage 3 median step, faults per step):

* glibc default: 699 / 803 ms, 113k / 141k faults;
* ``THP_MEM_ALLOC_ENABLE=1`` (torch's 2 MiB-aligned, ``MADV_HUGEPAGE`` allocations): 588 /
  718 ms, ~6k faults (the kernel still zeroes every page of every step);
* glibc's heap for everything (``mallopt(M_MMAP_MAX, 0)``, large ``M_TRIM_THRESHOLD``): 528 /
  601 ms, 0 faults, but rejected: the 64-byte ``posix_memalign`` needs slack that a freed hole
  of the same size lacks, so a loop allocating one 100 MB tensor with small allocations between
  grew the heap by 100 MB per round (glibc 2.36);
* jemalloc 5.3 (also with the ``MALLOC_CONF`` of ``torch.backends.xeon.run_cpu``): no gain,
  it purged the large extents and faulted as often as glibc;
* **tcmalloc** (gperftools' ``libtcmalloc_minimal``): 518 / 580 ms, ~0 faults, and the same
  loop's memory bounded (its page heap coalesces freed spans). Used.

``rank_env`` is the environment a CPU (gloo) rank is started with: ``LD_PRELOAD`` gets the
tcmalloc library when this machine has one (Debian/Ubuntu: ``apt install
libtcmalloc-minimal4``; ``torch.backends.xeon.run_cpu --enable-tcmalloc`` does the same for a
single process). Every launcher starts CPU ranks with it (``launch.spawn``, and torchrun / srun
through ``worker``), so every framework sharing a rank process (the peers race and its lower
bound) runs on the same allocator. ``ZR_HOST_HEAP=os`` keeps the C library's malloc (for an
A/B); ``ZR_HOST_HEAP=tcmalloc`` requires it. The mode is part of a measured CPU record's
machine signature (``harness.provenance``). GPU ranks are left alone (their tensors live in the
CUDA caching allocator).
"""
from __future__ import annotations

import functools
import glob
import os
import platform
import sys
import sysconfig

MODES = ("tcmalloc", "os")
LIBRARIES = ("tcmalloc_minimal", "tcmalloc")  # gperftools; either serves malloc/free
INSTALL_HINT = "apt install libtcmalloc-minimal4 (Debian/Ubuntu) or gperftools"


def _library_dirs() -> list[str]:
    """Where a tcmalloc is looked for (as ``torch.backends.xeon.run_cpu`` does: the
    environment's own lib directories first, then the system's), without starting a process
    (``ctypes.util.find_library`` runs ``ldconfig``)."""
    arch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    prefixes = [os.environ.get("CONDA_PREFIX", ""), os.environ.get("VIRTUAL_ENV", ""),
                sys.prefix, "/usr/local", "/usr", "/"]
    out = []
    for pre in filter(None, prefixes):
        for sub in (f"lib/{arch}", "lib64", "lib"):
            d = os.path.join(pre, sub)
            if d not in out:
                out.append(d)
    return out


@functools.lru_cache(maxsize=1)
def library() -> str | None:
    """Path of the tcmalloc shared library of this machine, or None."""
    for name in LIBRARIES:
        for d in _library_dirs():
            hits = sorted(glob.glob(os.path.join(d, f"lib{name}.so*")))
            if hits:
                return hits[0]
    return None


def mode() -> str:
    """The malloc CPU ranks run on: ``ZR_HOST_HEAP`` if set, else tcmalloc where this machine
    has it, else the C library's (``os``). ValueError for an unknown mode or a missing
    library that was asked for."""
    want = os.environ.get("ZR_HOST_HEAP", "")
    if want and want not in MODES:
        raise ValueError(f"ZR_HOST_HEAP={want!r}: use one of {', '.join(MODES)}")
    if want == "tcmalloc" and library() is None:
        raise ValueError(f"ZR_HOST_HEAP=tcmalloc but no tcmalloc library is installed: "
                         f"{INSTALL_HINT}, or unset ZR_HOST_HEAP")
    if want:
        return want
    return "tcmalloc" if library() is not None else "os"


def rank_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for starting a CPU rank under ``mode()``."""
    out = dict(os.environ if env is None else env)
    lib = library() if mode() == "tcmalloc" else None
    if lib is not None:
        preload = [p for p in out.get("LD_PRELOAD", "").split(":") if p]
        if not any("tcmalloc" in p for p in preload):
            out["LD_PRELOAD"] = ":".join([lib, *preload])
    return out


def in_use() -> str:
    """The malloc this process runs on, from its memory map: ``tcmalloc`` or ``os``."""
    try:
        with open("/proc/self/maps") as f:
            return "tcmalloc" if "tcmalloc" in f.read() else "os"
    except OSError:
        return "os"

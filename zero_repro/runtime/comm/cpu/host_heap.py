"""tcmalloc for CPU ranks: a caching malloc, as PyTorch's caching allocator is on GPU.

glibc serves every request over 32 MiB (its largest ``mmap`` threshold) with a fresh ``mmap``, so
each large tensor of each CPU step is new memory the kernel faults in; tcmalloc (gperftools'
``libtcmalloc_minimal``) keeps freed spans and bounds the heap. ``rank_env()`` is a CPU (gloo)
rank's environment: ``LD_PRELOAD`` names tcmalloc where installed (``apt install
libtcmalloc-minimal4``); every launcher uses it (``launch.spawn``, ``zero_repro.lab.launcher``),
so all frameworks of a rank process share one allocator. ``ZR_HOST_HEAP`` (``mode()``): ``os``
keeps the C library's malloc (an A/B), ``tcmalloc`` requires it; it enters a measured CPU
record's machine signature. GPU ranks are left alone. Timings and what was tried:
``results/peers/notes.md``.
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

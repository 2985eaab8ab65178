"""Which GPU this is, as a ``conf/cluster`` name (the GPU proof's ``experiment.params.cluster``:
its peak and device memory go into every record and every judgement): by the name CUDA reports
and the device memory, or checked against a named cluster before any point runs.
"""
from __future__ import annotations

import torch

from zero_repro import gpus
from zero_repro.scale.hardware import device_bytes, list_clusters, load_cluster


# the device memory has to agree within this (an A100's 40 and 80 GB, an H100 NVL's 94 GB, a
# MIG slice) once the name matches
CLUSTER_MEMORY_RTOL = 0.05


def gpu_clusters() -> dict:
    """conf/cluster/<name> of every cluster that names a GPU -> that GPU's ``cuda_name``
    (tokens all in the name ``torch.cuda.get_device_name`` reports, tokens none of which is in
    it; ``zero_repro.gpus``). PCIe/NVL variants have a lower peak than the SXM part: not matched."""
    out = {}
    for cluster in list_clusters():
        key = load_cluster(cluster).gpu
        if key:
            out[cluster] = gpus.gpu(key).cuda_name
    return out


def gpu_cluster(name: str, total_memory: int) -> str | None:
    """The ``conf/cluster`` name of a GPU reporting ``name`` (``torch.cuda.get_device_name``)
    and ``total_memory`` bytes (``get_device_properties``), or None when none matches."""
    up = name.upper()
    for cluster, (need, exclude) in gpu_clusters().items():
        if all(t in up for t in need) and not any(t in up for t in exclude):
            want = device_bytes(load_cluster(cluster))
            if abs(total_memory - want) <= CLUSTER_MEMORY_RTOL * want:
                return cluster
    return None


def _this_gpu() -> tuple[str, int] | None:
    """(name, total memory in bytes) of CUDA device 0, or None without CUDA."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    return torch.cuda.get_device_name(0), int(torch.cuda.get_device_properties(0).total_memory)


def cluster_name(p) -> str:
    """``experiment.params.cluster`` resolved (its peak and device memory go into every
    record): ``auto`` is this machine's GPU (``gpu_cluster``); a named ``conf/cluster`` must be
    a CUDA cluster and, on a machine with a GPU, that GPU (by name, else by memory for a GPU
    no cluster names). ValueError naming the setting to pass otherwise."""
    want = str(p.get("cluster", "auto"))
    gpu = _this_gpu()
    if want == "auto":
        if gpu is None:
            raise ValueError("experiment.params.cluster=auto reads the GPU model, and this "
                             "machine shows no CUDA device: name the GPU to plan for, e.g. "
                             f"experiment.params.cluster=h100 (one of {sorted(gpu_clusters())})")
        found = gpu_cluster(*gpu)
        if found is None:
            raise ValueError(f"this machine's GPU is {_gpu_words(gpu)}, which matches no GPU "
                             f"of conf/cluster (by name and memory): add conf/cluster/<name>.yaml"
                             f" for it and pass experiment.params.cluster=<name>")
        return found
    try:
        c = load_cluster(want)
    except ValueError:
        raise ValueError(f"experiment.params.cluster={want!r} is no conf/cluster/<name>.yaml: "
                         f"choose auto (this machine's GPU) or one of "
                         f"{sorted(gpu_clusters())}") from None
    if c.device != "cuda":
        raise ValueError(f"experiment.params.cluster={want} is not a GPU cluster: choose auto "
                         f"(this machine's GPU) or one of {sorted(gpu_clusters())}")
    if gpu is None:
        return want  # a plan for that GPU, made anywhere
    found = gpu_cluster(*gpu)
    if found is not None and found != want:
        raise ValueError(f"experiment.params.cluster={want} but this machine's GPU is "
                         f"{_gpu_words(gpu)}, i.e. {found}: pass experiment.params.cluster="
                         f"{found} (or auto)")
    want_bytes = device_bytes(c)
    if found is None and abs(gpu[1] - want_bytes) > CLUSTER_MEMORY_RTOL * want_bytes:
        raise ValueError(f"experiment.params.cluster={want} has {want_bytes / 2**30:.1f} GiB "
                         f"per device but this machine's GPU is {_gpu_words(gpu)}: pass the "
                         f"cluster of this GPU")
    return want


def _gpu_words(gpu: tuple[str, int]) -> str:
    return f"{gpu[0]!r} ({gpu[1] / 2**30:.1f} GiB)"


def cluster_overrides(name: str) -> dict:
    """The ``cluster.*`` overrides that put conf/cluster/<name> into a point's config."""
    c = load_cluster(name)
    return {f"cluster.{k}": getattr(c, k) for k in ("name", "device", "backend",
                                                     "gpus_per_node", "device_memory_gb",
                                                     "device_memory_mib", "peak_tflops")}

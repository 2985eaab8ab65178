"""Cluster specs as data: ``conf/cluster/<name>.yaml`` is their one home (schema:
``zero_repro.config.ClusterConfig``), read here for everyone that needs them outside Hydra's
``cluster=...`` choice: the performance model (``zero_repro.scale.hardware``), the memory dry run
and the paper-scale points (``cluster_overrides``). The paper's own cluster is ``dgx2_v100``
(§10.1: DGX-2 nodes of 16 V100-32GB, NVSwitch 300 GB/s, 800 Gbps internode).
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

from omegaconf import OmegaConf

from zero_repro.config import ClusterConfig
from zero_repro.paths import conf_group_dir

PAPER_CLUSTER = "dgx2_v100"


@lru_cache(maxsize=None)
def load_cluster(name: str) -> ClusterConfig:
    """Read ``conf/cluster/<name>.yaml`` into a typed ClusterConfig (Hydra defaults skipped)."""
    path = conf_group_dir("cluster") / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"cluster={name!r}: no {path}; choose one of {list_clusters()}")
    raw = OmegaConf.load(path)
    raw.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(ClusterConfig), raw)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def list_clusters() -> list[str]:
    return sorted(p.stem for p in conf_group_dir("cluster").glob("*.yaml"))


def cluster_overrides(name: str, fields: tuple[str, ...] | None = None) -> dict:
    """``cluster.<field>`` overrides of ``conf/cluster/<name>.yaml``: every field, or only
    ``fields`` (the memory dry run takes the device facts and keeps this machine's device and
    backend: ``DRYRUN_FIELDS``)."""
    c = dataclasses.asdict(load_cluster(name))
    return {f"cluster.{k}": v for k, v in c.items() if fields is None or k in fields}


# what a memory dry run needs of a cluster (it runs here, on the fake backend)
DRYRUN_FIELDS = ("name", "gpus_per_node", "device_memory_gb")

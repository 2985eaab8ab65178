"""The lab's schema glue (the configuration of ``config`` as Hydra and OmegaConf see it): the
dataclasses registered in Hydra's ConfigStore, a composed ``DictConfig`` turned into a typed
``Config`` (and back, ``summary``), configs saved and loaded as YAML, the model files under
``conf/model/``. The runtime never imports this module.
"""
from __future__ import annotations

import os
import secrets
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from zero_repro import paths
from zero_repro.config import (LOCAL_RESULTS, REFERENCE_RESULTS, CheckpointConfig, ClusterConfig,
                               Config, FaultConfig, LauncherConfig, LoggingConfig, ModelConfig,
                               ParallelConfig, SimulateConfig, TrainConfig, ZeroConfig,
                               ZeroRConfig)
from zero_repro.paths import conf_group_dir


def register_resolvers() -> None:
    """``${zr_home:}`` and ``${zr_run_id:}`` in ``conf/config.yaml`` (Hydra's run/sweep
    folders): ``paths.home()``, and a random id drawn once per composed config (cached in it,
    as Hydra's ``${now:}``, so a job's processes agree), which keeps the folders of two runs
    started in one second apart."""
    OmegaConf.register_new_resolver("zr_home", lambda: str(paths.home()),
                                    replace=True)
    OmegaConf.register_new_resolver("zr_run_id", lambda: secrets.token_hex(4),
                                    use_cache=True, replace=True)


def register_configs() -> None:
    register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in [("model", ModelConfig), ("parallel", ParallelConfig), ("zero", ZeroConfig),
                        ("zero_r", ZeroRConfig), ("train", TrainConfig),
                        ("cluster", ClusterConfig), ("launcher", LauncherConfig),
                        ("logging", LoggingConfig), ("checkpoint", CheckpointConfig),
                        ("fault", FaultConfig), ("simulate", SimulateConfig)]:
        cs.store(group=group, name=f"base_{group}", node=node)


def to_config(cfg: DictConfig | Config) -> Config:
    """DictConfig (from Hydra or a resolved YAML file) -> typed ``Config`` object.
    ``experiment.publish=true`` turns the default results directory into the reference set;
    the results directory becomes an absolute path (``paths.results_path``)."""
    if isinstance(cfg, Config):
        return cfg
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    out = OmegaConf.to_object(merged)
    e = out.experiment
    if e.publish and e.results_dir == LOCAL_RESULTS:
        e.results_dir = REFERENCE_RESULTS
    if e.results_dir:  # '' is refused by validate
        e.results_dir = str(paths.results_path(e.results_dir))
    return out  # type: ignore[return-value]


def load(path: str) -> Config:
    return to_config(OmegaConf.load(path))


def save(cfg: Config | DictConfig, path: str) -> None:
    tmp = path + ".tmp"
    OmegaConf.save(OmegaConf.structured(cfg) if isinstance(cfg, Config) else cfg, tmp)
    os.replace(tmp, path)


def summary(cfg: Config) -> dict[str, Any]:
    """The resolved config as nested plain dicts (a record's ``config``, W&B)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore


def model_files() -> dict:
    """Every conf/model/<name>.yaml as {name: fields} (``defaults`` dropped)."""
    out = {}
    for p in sorted(conf_group_dir("model").glob("*.yaml")):
        d = OmegaConf.to_container(OmegaConf.load(p))
        d.pop("defaults", None)
        out[p.stem] = d
    return out


def model_conf(name: str) -> dict:
    """The fields of conf/model/<name>.yaml (for local points' overrides)."""
    try:
        return dict(model_files()[name])
    except KeyError:
        raise ValueError(f"no conf/model/{name}.yaml; choose one of {sorted(model_files())}") from None

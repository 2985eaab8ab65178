"""A battery of bad inputs, every config group: each is refused before any process starts.

In process, through the CLI's own checks (``cli.prepare`` on a composed ``+exp=smoke`` config;
``cli.check_args`` for what only composition can see: Hydra errors, multirun jobs, the Hydra
output directory), with ``launch.spawn`` and ``subprocess`` patched to fail the test if
anything tries to start a rank. Each case asserts the user error is one line and names the
field. A few real ``python run.py`` runs prove the CLI turns that into exactly one ``error:``
line and exit status 2.
"""
from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests import REPO
from zero_repro.lab import cli, cli_checks
from zero_repro import schema
from zero_repro.runtime.comm import launch

NAN, INF = float("nan"), float("inf")

# (overrides on top of +exp=smoke, the field the message must name)
CASES: dict[str, tuple[dict, str]] = {
    # model
    "n_layer0": ({"model.n_layer": 0}, "model.n_layer"),
    "n_layer_neg": ({"model.n_layer": -1}, "model.n_layer"),
    "n_layer_str": ({"model.n_layer": "abc"}, "n_layer"),
    "n_embd0": ({"model.n_embd": 0}, "model.n_embd"),
    "n_head0": ({"model.n_head": 0}, "model.n_head"),
    "embd_heads": ({"model.n_embd": 50}, "model.n_embd"),
    "seq0": ({"model.seq_len": 0}, "model.seq_len"),
    "vocab0": ({"model.vocab_size": 0}, "model.vocab_size"),
    "pad0": ({"model.vocab_pad_multiple": 0}, "model.vocab_pad_multiple"),
    "dropout_neg": ({"model.dropout": -0.1}, "model.dropout"),
    "dropout_one": ({"model.dropout": 1.0}, "model.dropout"),
    "dropout_nan": ({"model.dropout": NAN}, "model.dropout"),
    "dropout_tp": ({"model.dropout": 0.1, "parallel.tp": 2}, "model.dropout"),
    "init_std_nan": ({"model.init_std": NAN}, "model.init_std"),
    "init_std_inf": ({"model.init_std": INF}, "model.init_std"),
    "init_std0": ({"model.init_std": 0.0}, "model.init_std"),
    "init_std_neg": ({"model.init_std": -0.02}, "model.init_std"),
    "bias_str": ({"model.bias": "maybe"}, "bias"),
    "model_100b_cpu": ({"model.n_layer": 125, "model.n_embd": 8192, "model.n_head": 64},
                       "train.micro_batch_size"),
    # parallel
    "world0": ({"parallel.world_size": 0}, "parallel.world_size"),
    "tp0": ({"parallel.tp": 0}, "parallel.tp"),
    "tp_neg": ({"parallel.tp": -1}, "parallel.tp"),
    "world_tp": ({"parallel.world_size": 3, "parallel.tp": 2}, "parallel.world_size"),
    "tp_heads": ({"parallel.tp": 3, "parallel.world_size": 3}, "parallel.tp"),
    "world64_cores": ({"parallel.world_size": 64}, "parallel.world_size"),
    # zero
    "stage4": ({"zero.stage": 4}, "zero.stage"),
    "stage_neg": ({"zero.stage": -1}, "zero.stage"),
    "stage_str": ({"zero.stage": "abc"}, "stage"),
    "dtype": ({"zero.dtype": "fp8"}, "zero.dtype"),
    "rbucket0": ({"zero.reduce_bucket_size": 0}, "zero.reduce_bucket_size"),
    "abucket_neg": ({"zero.allgather_bucket_size": -5}, "zero.allgather_bucket_size"),
    "prefetch_neg": ({"zero.prefetch_blocks": -1}, "zero.prefetch_blocks"),
    "clip_nan": ({"zero.grad_clip": NAN}, "zero.grad_clip"),
    "clip_inf": ({"zero.grad_clip": INF}, "zero.grad_clip"),
    "clip_neg": ({"zero.grad_clip": -1.0}, "zero.grad_clip"),
    "scale_power_huge": ({"zero.initial_scale_power": 5000}, "zero.initial_scale_power"),
    "scale_power_neg": ({"zero.initial_scale_power": -1}, "zero.initial_scale_power"),
    "scale_window0": ({"zero.loss_scale_window": 0}, "zero.loss_scale_window"),
    "min_scale0": ({"zero.min_loss_scale": 0.0}, "zero.min_loss_scale"),
    "min_scale_nan": ({"zero.min_loss_scale": NAN}, "zero.min_loss_scale"),
    "min_scale_above": ({"zero.dtype": "fp16", "zero.min_loss_scale": 1e9},
                        "zero.min_loss_scale"),
    "hysteresis0": ({"zero.hysteresis": 0}, "zero.hysteresis"),
    # zero_r
    "zero_r_name": ({"zero_r.name": "c9"}, "zero_r.name"),
    "pa_no_ckpt": ({"zero_r.partition_activations": True}, "zero_r.activation_checkpointing"),
    "cpu_no_pa": ({"zero_r.activation_checkpointing": True, "zero_r.cpu_checkpointing": True},
                  "zero_r.partition_activations"),
    # train
    "mb0": ({"train.micro_batch_size": 0}, "train.micro_batch_size"),
    "mb_huge": ({"train.micro_batch_size": 200000}, "train.micro_batch_size"),
    "accum0": ({"train.grad_accum": 0}, "train.grad_accum"),
    "steps0": ({"train.steps": 0}, "train.steps"),
    "warmup_neg": ({"train.warmup_steps": -1}, "train.warmup_steps"),
    "warmup_all": ({"train.warmup_steps": 8}, "train.warmup_steps"),
    "lr_nan": ({"train.lr": NAN}, "train.lr"),
    "lr_inf": ({"train.lr": INF}, "train.lr"),
    "lr_neg": ({"train.lr": -1.0}, "train.lr"),
    "lr0": ({"train.lr": 0.0}, "train.lr"),
    "beta1_2": ({"train.beta1": 2.0}, "train.beta1"),
    "beta1_neg": ({"train.beta1": -0.1}, "train.beta1"),
    "beta2_neg": ({"train.beta2": -1.0}, "train.beta2"),
    "beta2_one": ({"train.beta2": 1.0}, "train.beta2"),
    "eps_neg": ({"train.eps": -1.0}, "train.eps"),
    "eps0": ({"train.eps": 0.0}, "train.eps"),
    "eps_nan": ({"train.eps": NAN}, "train.eps"),
    "wd_nan": ({"train.weight_decay": NAN}, "train.weight_decay"),
    "wd_neg": ({"train.weight_decay": -0.1}, "train.weight_decay"),
    "lr_wd": ({"train.lr": 1.0, "train.weight_decay": 2.0}, "train.weight_decay"),
    "seed_neg": ({"train.seed": -1}, "train.seed"),
    "data": ({"train.data": "imagenet"}, "train.data"),
    "tokens_no_path": ({"train.data": "tokens", "train.data_path": ""}, "train.data_path"),
    "tokens_missing": ({"train.data": "tokens", "train.data_path": "/nonexistent/t.bin"},
                       "train.data_path"),
    "tokens_short": ({"train.data": "tokens", "train.data_path": "@short.bin"},
                     "train.data_path"),
    "tokens_vocab": ({"train.data": "tokens", "train.data_path": "@big_ids.bin"},
                     "model.vocab_size"),
    "pystdlib_vocab": ({"model.vocab_size": 100}, "model.vocab_size"),
    # cluster
    "device": ({"cluster.device": "tpu"}, "cluster.device"),
    "backend": ({"cluster.backend": "mpi"}, "cluster.backend"),
    "nccl_cpu": ({"cluster.backend": "nccl"}, "cluster.backend"),
    "fake_backend": ({"cluster.backend": "fake"}, "cluster.backend"),
    "gpus_per_node0": ({"cluster.gpus_per_node": 0}, "cluster.gpus_per_node"),
    "device_mem_neg": ({"cluster.device_memory_gb": -1.0}, "cluster.device_memory_gb"),
    "peak_nan": ({"cluster.peak_tflops": NAN}, "cluster.peak_tflops"),
    "intra_neg": ({"cluster.intra_node_gbps": -1.0}, "cluster.intra_node_gbps"),
    # launcher
    "launcher": ({"launcher.name": "mpirun"}, "launcher.name"),
    "ctimeout_nan": ({"launcher.collective_timeout_s": NAN}, "launcher.collective_timeout_s"),
    "ctimeout0": ({"launcher.collective_timeout_s": 0.0}, "launcher.collective_timeout_s"),
    "ctimeout_neg": ({"launcher.collective_timeout_s": -5.0}, "launcher.collective_timeout_s"),
    "timeout_min0": ({"launcher.timeout_min": 0}, "launcher.timeout_min"),
    "signal_delay_neg": ({"launcher.signal_delay_s": -1}, "launcher.signal_delay_s"),
    # logging
    "level": ({"logging.level": "FOO"}, "logging.level"),
    "wandb_mode": ({"logging.wandb_mode": "sometimes"}, "logging.wandb_mode"),
    # experiment
    "action": ({"experiment.action": "train"}, "experiment.action"),
    "results_empty": ({"experiment.results_dir": ""}, "experiment.results_dir"),
    "results_unwritable": ({"experiment.results_dir": "/proc/zr_results"},
                           "experiment.results_dir"),
    "exp_name": ({"experiment.name": "nosuch"}, "experiment"),
    # checkpoint
    "save_every_neg": ({"checkpoint.save_every": -1}, "checkpoint.save_every"),
    "keep_neg": ({"checkpoint.keep": -2}, "checkpoint.keep"),
    "resume_missing": ({"checkpoint.resume": "/nonexistent/step_00000002"}, "checkpoint.resume"),
    "resume_latest_none": ({"checkpoint.resume": "latest"}, "checkpoint.resume"),
    "resume_uncommitted": ({"checkpoint.resume": "latest", "checkpoint.dir": "@uncommitted"},
                           "none is committed"),
    "resume_garbage": ({"checkpoint.resume": "@garbage"}, "checkpoint.resume"),
    "resume_format": ({"checkpoint.resume": "@other_format"}, "checkpoint.resume"),
    "resume_foreign_tp": ({"checkpoint.resume": "@foreign_tp"}, "parallel.tp"),
    "resume_other_model": ({"checkpoint.resume": "@other_model", "parallel.tp": 2},
                           "model.n_layer"),
    "resume_past_end": ({"checkpoint.resume": "@past_end", "parallel.tp": 2}, "train.steps"),
    "ckpt_dir_unwritable": ({"checkpoint.save_every": 2, "checkpoint.dir": "/proc/zr_ckpt"},
                            "checkpoint.dir"),
    # fault
    "fault_rank": ({"fault.rank": 7}, "fault.rank"),
    "fault_step": ({"fault.rank": 0, "fault.step": 99}, "fault.step"),
    "fault_mode": ({"fault.mode": "explode"}, "fault.mode"),
}
if torch.cuda.is_available():  # these are refused only where the device is missing
    CASES.pop("nccl_cpu")
else:
    CASES["cuda_missing"] = ({"cluster.device": "cuda"}, "cluster.device")
    CASES["nccl_no_gpu"] = ({"cluster.device": "cuda", "cluster.backend": "nccl"}, "cluster.")

# what only composing the command line can see (cli.check_args)
ARGV_CASES = {
    "type": (["zero.stage=abc"], "zero.stage"),
    "unknown_key": (["train.nosuch=1"], "train.nosuch"),
    "unknown_group": (["model=gpt_nosuch"], "gpt_nosuch"),
    "parse": (["train.lr=[1"], "[1"),
    "multirun_second_job": (["-m", "train.lr=1e-3,-1"], "train.lr"),
    "multirun_world": (["-m", "parallel.world_size=2,64"], "parallel.world_size"),
    "hydra_dir": (["hydra.run.dir=/proc/zr_hydra"], "hydra.run.dir"),
}


def _manifest(path, **kw) -> str:
    os.makedirs(path, exist_ok=True)
    doc = {"format": "zero-repro-dcp/1", "step": 2, "tp": 2, "params": {}, "files": {},
           "extra": {}}
    doc.update(kw)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write(json.dumps(doc) if "raw" not in kw else kw["raw"])
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_inputs")
    np.arange(10, dtype=np.uint16).tofile(d / "short.bin")
    np.full(1000, 60000, dtype=np.uint16).tofile(d / "big_ids.bin")
    os.makedirs(d / "uncommitted" / "step_00000002")
    garbage = d / "garbage"
    garbage.mkdir()
    (garbage / "manifest.json").write_text("{not json")
    model = {"n_layer": 99, "n_embd": 64, "n_head": 4, "seq_len": 64, "vocab_size": 50257,
             "vocab_pad_multiple": 128, "bias": True}
    return {"short.bin": str(d / "short.bin"), "big_ids.bin": str(d / "big_ids.bin"),
            "uncommitted": str(d / "uncommitted"), "garbage": str(garbage),
            "other_format": _manifest(str(d / "other_format"), format="torch-dcp"),
            "foreign_tp": _manifest(str(d / "foreign_tp"), tp=4),
            "other_model": _manifest(str(d / "other_model"), extra={"model": model}),
            "past_end": _manifest(str(d / "past_end"), step=100), "root": str(d)}


@pytest.fixture(scope="module")
def base():
    schema.register_configs()
    with initialize_config_dir(config_dir=cli.conf_dir(), version_base="1.3"):
        return compose("config", overrides=["+exp=smoke"])


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a process was started for a bad input")

    monkeypatch.setattr(launch, "spawn", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def _apply(dcfg, overrides: dict, files: dict, results: str):
    d = copy.deepcopy(dcfg)
    OmegaConf.update(d, "experiment.results_dir", results, merge=False)
    for k, v in overrides.items():
        if isinstance(v, str) and v.startswith("@"):
            v = files[v[1:]]
        OmegaConf.update(d, k, v, merge=False)
    return d


def _assert_one_line(message: str, field: str) -> None:
    assert "\n" not in message and message.strip(), repr(message)
    assert field in message, f"{field!r} not named in: {message}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_refused_before_anything_starts(case, base, files, nothing_starts,
                                                     tmp_path):
    overrides, field = CASES[case]
    results = str(tmp_path / "results")
    with pytest.raises(cli.UserError) as e:
        try:
            cli.prepare(_apply(base, overrides, files, results))
        except Exception as err:  # noqa: BLE001 - OmegaConf type errors at update time
            if isinstance(err, cli.UserError):
                raise
            raise cli.UserError(cli_checks._first_line(err)) from None
    _assert_one_line(str(e.value), field)
    assert not os.path.exists(results), "something was written"


@pytest.mark.parametrize("case", sorted(ARGV_CASES))
def test_bad_command_line_is_refused_before_anything_starts(case, nothing_starts, tmp_path):
    args, field = ARGV_CASES[case]
    results = str(tmp_path / "results")
    with pytest.raises(cli.UserError) as e:
        cli.check_args([a for a in args if a.startswith("-")] + ["+exp=smoke"]
                       + [a for a in args if not a.startswith("-")]
                       + [f"experiment.results_dir={results}"])
    _assert_one_line(str(e.value), field)
    assert not os.path.exists(results)


def test_battery_size():
    assert len(CASES) + len(ARGV_CASES) >= 80


def test_oversubscribe_forces_the_resource_checks(base, files, nothing_starts, tmp_path):
    d = _apply(base, {"parallel.world_size": 64, "launcher.oversubscribe": True}, files,
               str(tmp_path / "r"))
    cfg, _, planned = cli.prepare(d)  # accepted: the user said so
    assert cfg.parallel.world_size == 64 and planned


def test_real_cli_prints_one_error_line_and_exits_2(tmp_path):
    results = tmp_path / "results"
    cases = [(["train.lr=nan"], "train.lr"),
             (["parallel.world_size=64"], "parallel.world_size"),
             (["logging.level=FOO"], "logging.level"),
             (["-m", "train.lr=1e-3,-1"], "train.lr")]

    def one(i):  # each its own Hydra run directory: two run at once
        args = cases[i][0]
        return subprocess.run([sys.executable, os.path.join(REPO, "run.py"), "+exp=smoke", *args,
                               f"experiment.results_dir={results}",
                               f"hydra.run.dir={tmp_path / 'hydra' / str(i)}",
                               f"hydra.sweep.dir={tmp_path / 'multirun'}"],
                              cwd=REPO, capture_output=True, text=True, timeout=180)

    with cf.ThreadPoolExecutor(2) as pool:  # two CLI starts at a time (2 cores)
        runs = list(pool.map(one, range(len(cases))))
    for (args, field), p in zip(cases, runs):
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2, (args, p.returncode, p.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], \
            (args, p.stderr[-2000:])
        assert "Traceback" not in p.stdout + p.stderr
        assert not results.exists() and not (tmp_path / "multirun").exists()

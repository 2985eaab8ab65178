"""Device and host bytes of ZeRO-Offload counted apart, by counters that are neither the runtime's
ledger nor the dry run's tracer (``lab.live_peak.measure_tiers``): on CPU ranks the host tier is
put in shared memory of its own (``live_peak.shm_zeros`` as ``offload.HOST_ALLOCATOR``), c10's CPU allocator counts every block
and the kernel's map of the process names the host's. Ren et al. 2021 §4.1: the device keeps
the lp parameters only (2Ψ + the buckets, not 4Ψ, at N_d = 1); with the parameters offloaded
too, the device keeps no shard of them, only the gathered working set and the buckets."""
from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from zero_repro import config as C
from zero_repro.lab import live_peak as LP
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.model import flops

H, VOCAB, SEQ, BUCKET = 128, 512, 32, 20_000
PAGE = 4096


def cfg(world: int, stage: int, opt: str, par: str = "none") -> dict:
    m = C.ModelConfig(name="tiers", n_layer=2, n_embd=H, n_head=4, seq_len=SEQ,
                      vocab_size=VOCAB, vocab_pad_multiple=8)
    c = C.Config(model=m, parallel=C.ParallelConfig(world_size=world, tp=1))
    c.cluster = dataclasses.replace(c.cluster, name="local", device="cpu", backend="gloo",
                                    device_memory_gb=0.0, gpus_per_node=world)
    c.zero = dataclasses.replace(c.zero, stage=stage, dtype="fp16", offload_optimizer=opt,
                                 offload_param=par, reduce_bucket_size=BUCKET,
                                 allgather_bucket_size=BUCKET)
    c.zero_r = C.ZeroRConfig(name="custom", constant_buffers=True)  # C_B: fixed buckets
    c.train = dataclasses.replace(c.train, micro_batch_size=2, progress=False)
    return OmegaConf.to_container(OmegaConf.structured(c))


def psi_padded(r: dict, world: int) -> int:
    """Ψ of the flat buffers, padding included: the host master's bytes / 4 x N_d."""
    return r["ledger"]["master_fp32_host"] // 4 * world


def slack(r: dict) -> int:
    return PAGE * r["host_mappings"]  # page rounding of the host's mappings


def test_one_rank_optimizer_offload_leaves_two_psi_plus_buckets_on_the_device():
    plain, off = spawn(LP.measure_tiers, 1, [cfg(1, 2, "none"), cfg(1, 2, "cpu")])[0]
    psi = psi_padded(off, 1)
    assert psi >= flops.param_count(C.ModelConfig(n_layer=2, n_embd=H, n_head=4, seq_len=SEQ,
                                                  vocab_size=VOCAB, vocab_pad_multiple=8))
    buckets = off["ledger"]["comm_buffers"]
    assert buckets < psi  # C_B: the buckets are fixed, far below a model-size buffer
    # the device at rest: the lp parameters and the buckets, nothing else (not 4Ψ)
    assert 2 * psi + buckets - slack(off) <= off["device_rest"] <= 2 * psi + buckets
    assert off["device_rest"] < 3 * psi < 4 * psi
    # the host: master, m, v (12Ψ), the lp staging (2Ψ) and one block of fp32 scratch
    assert off["host"] - slack(off) <= off["ledger_host"] <= off["host"]
    assert 14 * psi <= off["host"] <= 14 * psi + 4 * BUCKET * 4 + slack(off)
    # without offload the same device holds the optimizer too: at least 14Ψ at rest
    assert plain["host"] == 0 and plain["device_rest"] >= 14 * psi
    assert off["device_peak"] < plain["device_peak"] - 10 * psi


def _param_offload_on_the_device(world: int):
    out = spawn(LP.measure_tiers, world, [cfg(world, 3, "cpu"), cfg(world, 3, "cpu", "cpu")])
    block = 2 * (12 * H * H + 13 * H)  # one block gathered, fp16 bytes (the largest unit)
    for rank, (opt, both) in enumerate(out):
        shard = 2 * psi_padded(opt, world) // world
        assert both["ledger"].get("params_lp", 0) == 0 and \
            both["ledger"]["params_lp_host"] == shard
        # the shard left the device: at rest and at the peak, by its bytes
        assert abs(opt["device_rest"] - both["device_rest"] - shard) <= slack(both), rank
        assert both["device_peak"] <= opt["device_peak"] - shard + slack(both), rank
        # what stays at rest is gathered units (a unit and its prefetch at most) + buckets
        assert both["device_rest"] <= 2 * block + both["ledger"]["comm_buffers"], rank
        assert both["host"] - slack(both) <= both["ledger_host"] <= both["host"], rank


def test_parameter_offload_leaves_no_parameter_shard_on_the_device_world_2():
    _param_offload_on_the_device(2)


@pytest.mark.slow
def test_parameter_offload_leaves_no_parameter_shard_on_the_device_world_4():
    _param_offload_on_the_device(4)

"""Parameter counts against the paper's nominal sizes and the built model; the FLOPs formula
against torch's FlopCounterMode on a real forward+backward (with and without recompute)."""
from __future__ import annotations

import dataclasses
import glob
import os

import pandas as pd
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from tests.unit.test_model_tp import ROOT, load_model_cfg
from zero_repro.config import ModelConfig, padded_vocab
from zero_repro.runtime.comm import comm
from zero_repro.runtime.model import flops
from zero_repro.runtime.model.gpt import GPT

PAPER_MODELS = sorted(os.path.basename(p)[:-5]
                      for p in glob.glob(str(ROOT / "conf" / "model" / "gpt_*.yaml"))
                      if os.path.basename(p) not in ("gpt_20m.yaml", "gpt_124m.yaml"))  # ours
# REFERENCE.md: "The 1.38B baseline (40 layers x 1536) comes to about 1.2B by 12Lh^2 + Vh" -
# the paper's own label is off, so that size is checked against the documented ~1.21B instead
KNOWN_MISLABELLED = {"1.38B": 1.21e9}


def _nominal(s: str) -> float:
    assert s.endswith("B"), s
    return float(s[:-1]) * 1e9


def test_paper_yaml_shapes_come_from_reference_csv():
    ref = pd.read_csv(ROOT / "results" / "paper" / "reference.csv")
    ref = ref[ref.figure.str.endswith("_config")]
    shapes = set()
    for _, g in ref.groupby(["figure", "series", "x_value"]):
        d = dict(zip(g.y_name, g.y_value))
        shapes.add((int(d["layers"]), int(d["hidden_size"])))
    assert len(PAPER_MODELS) == len(shapes) == 23
    got = set()
    for name in PAPER_MODELS:
        cfg = load_model_cfg(name)
        assert (cfg.seq_len, cfg.vocab_size, cfg.vocab_pad_multiple) == (1024, 50257, 128)
        assert cfg.n_embd % cfg.n_head == 0
        got.add((cfg.n_layer, cfg.n_embd))
    assert got == shapes


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_param_count_matches_nominal(name):
    cfg = load_model_cfg(name)
    n = flops.param_count(cfg)
    target = KNOWN_MISLABELLED.get(cfg.nominal, _nominal(cfg.nominal))
    assert abs(n / target - 1) < 0.07, (name, n)


def test_headline_sizes():
    for name, nominal, tol in [("gpt_60b_75x8192", 60e9, 0.02), ("gpt_40b_88x6144", 40e9, 0.01),
                               ("gpt_1p5b_48x1600", 1.5e9, 0.04), ("gpt_100b", 100e9, 0.02)]:
        assert abs(flops.param_count(load_model_cfg(name)) / nominal - 1) < tol, name


def test_formula_equals_built_model():
    for cfg, tp in [(ModelConfig(), 1), (ModelConfig(n_layer=3, n_embd=48, n_head=6, seq_len=32,
                                                     vocab_size=1000, vocab_pad_multiple=64), 2),
                    (dataclasses.replace(ModelConfig(), bias=False), 4)]:
        model = GPT(cfg, device="meta")
        n = sum(p.numel() for p in model.parameters())
        assert n == flops.param_count(cfg)
        if cfg.bias:
            assert n == flops.param_count_formula(cfg.n_layer, cfg.n_embd, padded_vocab(cfg, 1),
                                                  cfg.seq_len)
        group = comm.Group("tp", tuple(range(tp)), tp - 1, None, comm.CommLedger())
        shard = GPT(cfg, group, device="meta")
        assert sum(p.numel() for p in shard.parameters()) == flops.param_count_per_tp_rank(cfg, tp)
    assert flops.param_count(ModelConfig(), padded=False) < flops.param_count(ModelConfig())


class _Recompute(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize("recompute", [False, True])
def test_flops_formula_matches_counted_matmuls(recompute):
    # vocab already a multiple of the padding so the formula's V is the model's V
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=96,
                      vocab_pad_multiple=8)
    model = GPT(cfg, seed=0)
    if recompute:
        model.blocks = torch.nn.ModuleList(_Recompute(b) for b in model.blocks)
    b = 3
    idx = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len))
    # the math SDPA backend decomposes into bmm, which FlopCounterMode counts (the fused CPU
    # kernel is not counted); early stop off so the recompute replays the whole block
    with sdpa_kernel(SDPBackend.MATH), set_checkpoint_early_stop(False), \
            FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    expected = flops.flops_per_iteration(b, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.vocab_size,
                                         recompute=recompute)
    assert counter.get_total_flops() == expected
    assert expected == flops.flops_per_iteration_cfg(cfg, b, recompute=recompute)


def test_flops_recompute_ratio_and_tflops():
    f96 = flops.flops_per_iteration(16, 1024, 75, 8192, 51200, recompute=True)
    f72 = flops.flops_per_iteration(16, 1024, 75, 8192, 51200, recompute=False)
    assert 1.30 < f96 / f72 < 4 / 3  # the LM head is not recomputed
    assert flops.tflops_per_gpu(4e15, 2.0, 50) == pytest.approx(40.0)
    with pytest.raises(ValueError):
        flops.tflops_per_gpu(1.0, 0.0, 1)


@pytest.mark.parametrize("ckpt,peak", [(True, 0.0), (False, 125.0)])
def test_rates_are_the_three_numerators_over_the_runs_gpus(ckpt, peak):
    """``Rates.of``: B = micro-batch x accumulation x DP sequences of s tokens on DP x TP GPUs;
    the paper's TFLOPs count the recompute when checkpointing is on, MFU's never, HFU's when
    it runs; mfu / hfu only against a known peak."""
    from zero_repro import config as C

    cfg = C.Config()
    cfg.model = ModelConfig(name="r", n_layer=4, n_embd=128, n_head=4, seq_len=64,
                            vocab_size=1000)
    cfg.train.micro_batch_size, cfg.train.grad_accum, cfg.parallel.tp = 3, 2, 2
    cfg.zero_r.activation_checkpointing = ckpt
    r = flops.Rates.of(cfg, dp=5)
    b, gpus, dt = 3 * 2 * 5, 10, 0.25
    assert (r.tokens_per_step, r.n_gpus) == (b * 64, gpus)
    at = r.at(dt, peak)
    assert at["tokens_per_s"] == b * 64 / dt
    assert at["tflops_per_gpu"] == flops.tflops_per_gpu(
        flops.flops_per_iteration_cfg(cfg.model, b, recompute=ckpt), dt, gpus)
    assert at["model_tflops_per_gpu"] == flops.tflops_per_gpu(
        flops.flops_per_iteration_cfg(cfg.model, b, recompute=False, causal=True), dt, gpus)
    assert at["hardware_tflops_per_gpu"] == flops.tflops_per_gpu(
        flops.flops_per_iteration_cfg(cfg.model, b, recompute=ckpt, causal=True), dt, gpus)
    assert (at["hardware_tflops_per_gpu"] > at["model_tflops_per_gpu"]) == ckpt
    assert ("mfu" in at) == ("hfu" in at) == (peak > 0)
    if peak:
        assert at["mfu"] == at["model_tflops_per_gpu"] / peak

"""Hugging Face models trained the way their users write it, at stages 0-3 (slow; needs
``transformers``, models built from configs: no downloads).

GPT-2 and Llama, world 2 on gloo, against one process training the same model with plain torch:
Hugging Face's own weight-decay recipe (``transformers.trainer_pt_utils.get_parameter_names``:
no decay for LayerNorm / RMSNorm weights and biases, grouped on the model's parameters),
gradients accumulated with two ``strategy.backward(loss / 2)`` calls per step, an LR scheduler
stepped after each step. Every parameter within 1e-5 after 3 steps, read through
``strategy.full_state_dict()``.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.zero import build_strategy

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

VOCAB, SEQ, ROWS, STEPS, TOL = 96, 16, 4, 3, 1e-5


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=SEQ)
        model = transformers.LlamaForCausalLM(cfg)
    return model.float()


def hf_groups(model: nn.Module):
    """The Trainer's recipe (``Trainer.get_decay_parameter_names``): decay everything but
    biases and the norms' weights, grouped on the model's own parameters."""
    from transformers.trainer_pt_utils import get_parameter_names
    norms = [nn.LayerNorm] + [m for n, m in vars(transformers.models.llama.modeling_llama).items()
                              if n == "LlamaRMSNorm"]
    decay = {n for n in get_parameter_names(model, norms) if "bias" not in n}
    named = list(model.named_parameters())
    return torch.optim.AdamW(
        [{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
         {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], lr=1e-2)


def data(step: int, world: int):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, VOCAB, (ROWS * world, SEQ), generator=g)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def reference(kind: str, world: int) -> dict:
    model = build(kind)
    opt = hf_groups(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        ids = data(step, world)
        for half in ids.chunk(2):  # the same micro-batch means as on the ranks
            (loss_of(model, half) / 2).backward()
        opt.step()
        sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker(rank: int, world: int, cases) -> list:
    out = []
    for kind, stage in cases:
        model = build(kind)
        opt = hf_groups(model)
        strategy = build_strategy(model, Topology.build(1),
                                  ZeroConfig(stage=stage, grad_clip=0.0,
                                             reduce_bucket_size=4000,
                                             allgather_bucket_size=4000),
                                  TrainConfig(), ZeroRConfig(), optimizer=opt, device="cpu")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(STEPS):
            ids = data(step, world)
            per = ids.shape[0] // world // 2
            mine = ids[rank * ROWS:(rank + 1) * ROWS]
            for j in range(2):  # two backward calls, the torch way
                strategy.backward(loss_of(strategy.module, mine[j * per:(j + 1) * per]) / 2)
            strategy.step()
            strategy.zero_grad()
            sched.step()
        out.append(strategy.full_state_dict())
        strategy.remove_hooks()
    return out


CASES = [(k, s) for k in ("gpt2", "llama") for s in (0, 1, 2, 3)]


def test_hf_models_with_the_hf_recipe_and_torch_accumulation_match_one_process():
    results = spawn(worker, 2, CASES, timeout_s=600)[0]
    refs = {k: reference(k, 2) for k in ("gpt2", "llama")}
    for (kind, stage), full in zip(CASES, results):
        ref = refs[kind]
        assert set(full) == set(ref), (kind, stage)
        errs = {k: (full[k] - v).abs().max().item() for k, v in ref.items()}
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, (kind, stage, worst, errs[worst])

"""The 2019 Megatron-LM GPT-2 layer and loss as the paper's harness ran them (ZeRO paper §10.1
"GPT-2 like transformer based models"; DeepSpeedExamples@405ce794 Megatron-LM), for the
``paper2020`` stack of the memory dry run.

Same parameter names and shapes as ``zero_repro.runtime.model.gpt`` (``Block``: ln_1, attn.qkv,
attn.proj, ln_2, mlp.fc, mlp.proj; ``GPT``: wte, wpe, blocks, ln_f), so activation
checkpointing and every ZeRO strategy wrap it unchanged and its weights are interchangeable
with the project's model. Only what autograd keeps differs; each difference is one switch of
``stack.switches.Stack`` (per layer, b batch, s sequence, h hidden, a heads, t TP degree):

  materialized_scores      q·kᵀ -> /sqrt(d) -> ·mask - 10000·(1-mask) -> softmax, all fp16
                           (b, a/t, s, s); softmax output saved (2·b·(a/t)·s² B) and, without
                           dropout, also the probs the context matmul saves (the same tensor)
  dropout_masks            p=0.1 on probs, attention output, MLP output, embeddings: output +
                           1-byte mask saved per dropout (probs: 3·b·(a/t)·s² B extra)
  tanh_gelu_intermediates  GELU op by op: 6 more (b, s, 4h/t) fp16 tensors saved
  fp32_logits              fp32 logits copy + CE clone + exp_logits (b·s·V/t·4 B each)

TP layout as the Megatron layer: QKV column-parallel over heads (a/t heads per rank, QKV of a
head contiguous as in ``gpt.CausalSelfAttention``), projections row-parallel.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from zero_repro.config import ModelConfig
from zero_repro.runtime.comm import comm
from zero_repro.runtime.model.gpt import GPT, causal_attention, remember_names
from zero_repro.runtime.model.tp import (ColumnParallelLinear, RowParallelLinear, copy_to_tp,
                                 vocab_parallel_cross_entropy)
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.dryrun.stack.categories import category

_GELU_C = math.sqrt(2.0 / math.pi)  # 0.7978845608...


def saved_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout that keeps its mask for backward, as CUDA's fused dropout does (1 B/element).

    ``aten.native_dropout`` returns (output, bool mask) and its autograd formula saves the mask;
    ``F.dropout`` on a CPU (fake) tensor would instead save an fp16 noise tensor."""
    if not training or p <= 0.0:
        return x
    out, _mask = torch.ops.aten.native_dropout(x, p, True)
    return out


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    """0.5·x·(1 + tanh(sqrt(2/π)·x·(1 + 0.044715·x²))), one aten op per operation, so autograd
    keeps what the 2019 jit-scripted function's autodiff keeps (both factors of every product,
    tanh's output)."""
    inner = (0.044715 * x) * x
    arg = (_GELU_C * x) * (1.0 + inner)
    return (0.5 * x) * (1.0 + torch.tanh(arg))


class CausalMask:
    """The (1, 1, s, s) lower-triangular mask the 2019 model gets as an input (built once per
    batch by get_batch, converted to fp16 by FP16_Module), shared by every layer."""

    def __init__(self):
        self._mask: torch.Tensor | None = None

    def get(self, s: int, dtype: torch.dtype, device) -> torch.Tensor:
        m = self._mask
        if m is None or m.shape[-1] != s or m.dtype != dtype:
            with category(S.WORKING_LAYER):
                m = torch.ones(s, s, dtype=dtype, device=device).tril_().view(1, 1, s, s)
            self._mask = m
        return m


class Attention2019(nn.Module):
    def __init__(self, cfg: ModelConfig, group: comm.Group, stack: S.Stack, mask: CausalMask,
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        if cfg.n_head % group.size:
            raise ValueError(f"TP size {group.size} does not divide n_head={cfg.n_head}")
        self.n_head_local = cfg.n_head // group.size
        self.head_dim = cfg.n_embd // cfg.n_head
        self.stack, self.mask = stack, mask
        self.p = stack.dropout_p if stack.dropout_masks else 0.0
        self.qkv = ColumnParallelLinear(cfg.n_embd, 3 * cfg.n_embd, group, bias=cfg.bias, **kw)
        self.proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, group, bias=cfg.bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.n_head_local, 3, self.head_dim)
        q, k, v = (u.transpose(1, 2) for u in qkv.unbind(dim=3))  # (b, a/t, s, d)
        if self.stack.materialized_scores:
            mask = self.mask.get(s, x.dtype, x.device)
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            scores = torch.mul(scores, mask) - 10000.0 * (1.0 - mask)  # (b, a/t, s, s)
            probs = torch.softmax(scores, dim=-1)  # fp16 in, fp16 out
            probs = saved_dropout(probs, self.p, self.training)
            y = torch.matmul(probs, v)  # (b, a/t, s, d)
        else:  # fused attention: no s² tensor kept (attention dropout needs the probs)
            y = causal_attention(q, k, v, 0.0)  # the CUDA kernel (model.gpt)
        y = y.transpose(1, 2).reshape(b, s, self.n_head_local * self.head_dim)
        return saved_dropout(self.proj(y), self.p, self.training)


class MLP2019(nn.Module):
    def __init__(self, cfg: ModelConfig, group: comm.Group, stack: S.Stack, device=None,
                 dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.stack = stack
        self.p = stack.dropout_p if stack.dropout_masks else 0.0
        self.fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, group, bias=cfg.bias, **kw)
        self.proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, group, bias=cfg.bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hdn = self.fc(x)  # (b, s, 4h/t)
        hdn = tanh_gelu(hdn) if self.stack.tanh_gelu_intermediates else F.gelu(hdn)
        return saved_dropout(self.proj(hdn), self.p, self.training)


class Block2019(nn.Module):
    """GPT2ParallelTransformerLayer (pre-LN): x + attn(ln_1(x)), then + mlp(ln_2(.)).
    ``block(x) -> x`` like ``gpt.Block``."""

    def __init__(self, cfg: ModelConfig, group: comm.Group, stack: S.Stack,
                 mask: CausalMask | None = None, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, **kw)
        self.attn = Attention2019(cfg, group, stack, mask or CausalMask(), **kw)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, **kw)
        self.mlp = MLP2019(cfg, group, stack, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# ------------------------------------------------------------------------ loss
class _MegatronCE(torch.autograd.Function):
    """Vocabulary-parallel cross entropy as mpu/cross_entropy.py@405ce794 holds memory: a clone
    of the fp32 logits is shifted by the global max, exp() makes a further tensor, which is
    normalised in place, saved, and turned into the input gradient in place in backward.
    Padded vocabulary columns take part in the softmax (the 2019 code does not mask them)."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start):
        z = logits.clone()
        zmax = z.max(dim=-1).values
        comm.all_reduce(zmax, group, op="max")
        z.sub_(zmax.unsqueeze(-1))
        e = z.exp()
        sum_e = e.sum(dim=-1)
        comm.all_reduce(sum_e, group)
        local_t = targets - vocab_start
        outside = (local_t < 0) | (local_t >= z.shape[-1])
        local_t = local_t.masked_fill(outside, 0)
        rows = torch.arange(z.shape[0], device=z.device)
        target_z = z[rows, local_t].masked_fill(outside, 0.0)
        comm.all_reduce(target_z, group)
        loss = sum_e.log() - target_z  # per token
        e.div_(sum_e.unsqueeze(-1))
        ctx.save_for_backward(e, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, outside = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        softmax[rows, local_t] -= (~outside).to(softmax.dtype)
        softmax.mul_(grad.unsqueeze(-1))  # the saved tensor becomes the gradient
        return softmax, None, None, None


def fp32_then_half(make):
    """``make_model`` as DSE@07d1ce0d pretrain_gpt2.py L76-80 built it (switch
    ``fp32_model_on_gpu_before_half``): the model made in fp32 on the device (``model.cuda()``),
    then halved parameter by parameter by ``FP16_Module`` (``module.half()``: each fp16 copy
    made before its fp32 tensor is freed, the fp32 blocks left in the allocator's cache)."""
    def _make(cfg, topo, device, dtype):
        with category(S.BUILD):
            model = make(cfg, topo, device, torch.float32)
        return model.to(dtype)
    return _make


class GPT2019(GPT):
    """``GPT`` with ``Block2019`` blocks and, with ``fp32_logits``, FP16_Module's fp32 output and
    the 2019 cross entropy. Built without ever creating ``gpt.Block``s (a dry run would trace
    their parameters)."""

    def __init__(self, cfg: ModelConfig, stack: S.Stack, tp_group: comm.Group | None = None,
                 device=None, dtype=None, seed: int = 0):
        # the base builds embeddings and ln_f only (n_layer=0), then the 2019 blocks are added
        super().__init__(dataclasses.replace(cfg, n_layer=0, dropout=0.0), tp_group,
                         device=device, dtype=dtype, seed=seed)
        self.cfg, self.stack = cfg, stack
        self.mask = CausalMask()
        kw = dict(device=device, dtype=dtype)
        self.blocks = nn.ModuleList(Block2019(cfg, self.tp_group, stack, self.mask, **kw)
                                    for _ in range(cfg.n_layer))
        remember_names(self)
        if torch.device(device or "cpu").type != "meta" and cfg.n_layer:
            self.init_weights(seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds model.seq_len={self.cfg.seq_len}")
        p = self.stack.dropout_p if self.stack.dropout_masks else 0.0
        with category(S.WORKING_LAYER):
            pos = torch.arange(t, device=idx.device)
            x = saved_dropout(self.wte(idx) + self.wpe(pos), p, self.training)
        for block in self.blocks:
            x = block(x)
        with category(S.LOGITS_LOSS):
            x = self.ln_f(x)
            x = copy_to_tp(x, self.tp_group)
            if targets is None:
                return F.linear(x, self.wte.weight), None
            # FP16_Module drops the fp16 output once converted: no name keeps it alive here
            return self._loss([F.linear(x, self.wte.weight)], targets)  # fp16 (b, s, V/t)

    def _loss(self, holder: list, targets: torch.Tensor):
        logits = holder.pop()
        b, t, v = logits.shape
        if not self.stack.fp32_logits:
            loss = vocab_parallel_cross_entropy(logits.view(b * t, v), targets.reshape(b * t),
                                                self.tp_group,
                             vocab_size=self.cfg.vocab_size)
            return logits, loss
        logits32 = logits.float()  # FP16_Module.forward: fp16_to_fp32 of the output
        del logits
        start = self.wte.vocab_start if self.tp_group.size > 1 else 0
        losses = _MegatronCE.apply(logits32.view(b * t, v), targets.reshape(b * t),
                                   self.tp_group, start)
        return logits32, losses.mean()

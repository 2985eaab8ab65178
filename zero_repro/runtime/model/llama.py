"""Llama-shaped language model with Megatron tensor parallelism, beside the GPT-2 one
(``model.family=llama``; Touvron et al. 2023, arXiv:2302.13971 §2.2 and arXiv:2307.09288 §2.2;
Llama 3: arXiv:2407.21783 §3.2). ZeRO trains it unchanged: the model knows nothing of ZeRO.

Pre-norm blocks ``x + attn(rmsnorm(x))``, then ``x + mlp(rmsnorm(x))``; RMSNorm (no bias), SwiGLU
MLP ``down(silu(gate(x)) * up(x))`` of width f = ``config.ffn_width``, rotary positions on q and
k (base ``rope_theta``), grouped-query attention (``n_kv_head`` key/value heads, each read by
n_head/n_kv_head query heads), no biases, no dropout, an LM head untied from the token
embedding. Parameters (padded vocabulary V, head size d = h/a, kv width k = n_kv_head·d):

    Ψ = l·(2h² + 2hk + 3hf + 2h) + 2Vh + h     (``flops.param_count``)

Tensor parallelism (TP degree t): q, k, v (one fused linear) and gate, up (one fused linear)
are column-parallel, o and down row-parallel (per block 2 all-reduces forward, 2 backward, as
GPT's), the token embedding
vocabulary-parallel, the LM head a column-parallel linear over the vocabulary whose split
logits feed the vocabulary-parallel cross entropy (Megatron's untied output layer). Rule for
the key/value heads: t must divide ``n_kv_head`` (``config.validate``); rank r keeps query
heads [r·a/t, (r+1)·a/t) and key/value heads [r·g/t, (r+1)·g/t) -- with contiguous slices the
kv heads a query head reads are on its own rank. Replicating kv heads for t > n_kv_head is not
implemented.

Attention: k and v are repeated to the query heads before the fused causal kernel
(``gpt.causal_attention``, the dry run's CUDA kernel on meta), as Hugging Face's sdpa path
does; a kernel with native GQA would not hold the (a - g)/a repeated part.

TP-consistent init (``decoder.Decoder``, as GPT's): every full (t = 1) tensor drawn from a
generator seeded by (seed, name), this rank keeps its slice; weights N(0, init_std), o and down scaled by
1/sqrt(2l), norms 1, vocabulary padding rows 0 (their logits are masked in the loss, so they
stay 0). Parameter names: ``tok_emb``, ``blocks.i.{attn_norm, attn.{qkv, o}, mlp_norm,
mlp.{gate_up, down}}``, ``ln_f`` (the final RMSNorm, named as GPT's so the dry run's category
hooks find it), ``lm_head``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zero_repro.config import ModelConfig, ffn_width, kv_heads
from zero_repro.runtime.comm import comm
from zero_repro.runtime.model.decoder import Decoder, causal_attention
from zero_repro.runtime.model.tp import (ColumnParallelLinear, RowParallelLinear,
                                         VocabParallelEmbedding)

# parameters whose first dimension is the padded vocabulary
VOCAB_ROWS = ("tok_emb.weight", "lm_head.weight")


class Rotary:
    """cos / sin tables of the rotary positions, (T, d) each, made once per (T, device, dtype)
    and shared by every attention layer of a model (a plain object: no parameters, no
    buffers, nothing for ZeRO to flatten)."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        self._tables: dict = {}

    def tables(self, t: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (t, str(device), dtype)
        if key not in self._tables:
            d = self.head_dim
            inv = 1.0 / self.theta ** (torch.arange(0, d, 2, device=device,
                                                    dtype=torch.float32) / d)  # (d/2,)
            ang = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)
            ang = torch.cat((ang, ang), dim=-1)  # (T, d): the rotate-half pairing
            self._tables[key] = (ang.cos().to(dtype), ang.sin().to(dtype))
        return self._tables[key]


class _RMSNorm(torch.autograd.Function):
    """y = x · rsqrt(mean(x²) + eps) · w, statistics in fp32; saves what CUDA's fused kernel
    saves (the input and the fp32 rstd, ``aten._fused_rms_norm``), so memory is the same on
    every device (torch's composite path, taken on CPU and meta, also keeps an fp32 copy of
    the input and the normalised output)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = grad.float() * weight.float()
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = (grad.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no bias): ``_RMSNorm``."""

    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, d) rotated by the position's angles: pairs (i, i + d/2) as in Hugging
    Face's ``rotate_half`` (Meta's checkpoint interleaves the pairs; the same map up to a fixed
    permutation of each head's q/k rows)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query attention. ``qkv`` is one column-parallel linear (one TP all-reduce of
    the input gradient, as Megatron's fused QKV) whose output rows are group-major: for each
    key/value head j, its ``rep`` query heads, then k_j, then v_j ((g, rep + 2, d); Megatron-LM
    ``core/transformer/attention.py``, ``get_query_key_value_tensors``), so a contiguous TP
    slice is whole groups and the layout does not depend on the TP degree."""

    def __init__(self, cfg: ModelConfig, group: comm.Group, rotary: Rotary, device=None,
                 dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        h, a, g = cfg.n_embd, cfg.n_head, kv_heads(cfg)
        self.head_dim, self.rep = h // a, a // g
        self.n_kv_local = g // group.size
        self.rotary = rotary
        self.qkv = ColumnParallelLinear(h, (a + 2 * g) * self.head_dim, group, bias=False, **kw)
        self.o = RowParallelLinear(h, h, group, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d, rep, g = self.head_dim, self.rep, self.n_kv_local
        y = self.qkv(x).view(b, t, g, rep + 2, d)  # (B, T, g/tp, rep + 2, d)
        q = y[:, :, :, :rep].reshape(b, t, g * rep, d).transpose(1, 2)  # (B, a/tp, T, d)
        k, v = (y[:, :, :, i].transpose(1, 2) for i in (rep, rep + 1))  # (B, g/tp, T, d)
        cos, sin = self.rotary.tables(t, x.device, q.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # (B, heads, T, d)
        if rep > 1:  # query head i of a group reads the group's kv head
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = causal_attention(q, k, v, 0.0)
        return self.o(y.transpose(1, 2).reshape(b, t, g * rep * d))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate and up are one column-parallel linear (one TP
    all-reduce of the input gradient) whose output rows alternate gate_i, up_i, so a
    contiguous TP slice is whole (gate, up) pairs at any TP degree."""

    def __init__(self, cfg: ModelConfig, group: comm.Group, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        h, f = cfg.n_embd, ffn_width(cfg)
        self.gate_up = ColumnParallelLinear(h, 2 * f, group, bias=False, **kw)
        self.down = RowParallelLinear(f, h, group, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate_up(x).unflatten(-1, (-1, 2))  # (B, T, f/tp, 2)
        return self.down(F.silu(y[..., 0]) * y[..., 1])


class LlamaBlock(nn.Module):
    """``block(x) -> x``: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, group: comm.Group, rotary: Rotary, device=None,
                 dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.attn_norm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps, **kw)
        self.attn = Attention(cfg, group, rotary, **kw)
        self.mlp_norm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps, **kw)
        self.mlp = SwiGLU(cfg, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(Decoder):
    VOCAB_ROWS = VOCAB_ROWS

    def __init__(self, cfg: ModelConfig, tp_group: comm.Group | None = None, device=None,
                 dtype=None, seed: int = 0, init_on: str = "cpu"):
        super().__init__(cfg, tp_group)
        if cfg.family != "llama":
            raise ValueError(f"Llama built from model.family={cfg.family!r}")
        group = self.tp_group
        kw = dict(device=device, dtype=dtype)
        self.rotary = Rotary(cfg.n_embd // cfg.n_head, cfg.rope_theta)
        self.tok_emb = VocabParallelEmbedding(self.vocab_padded, cfg.n_embd, group, **kw)
        self.blocks = nn.ModuleList(LlamaBlock(cfg, group, self.rotary, **kw)
                                    for _ in range(cfg.n_layer))
        self.ln_f = RMSNorm(cfg.n_embd, eps=cfg.norm_eps, **kw)
        self.lm_head = ColumnParallelLinear(cfg.n_embd, self.vocab_padded, group, bias=False,
                                            **kw)
        self.finish(device, seed, init_on)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx)  # (B, T, h)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V_pad/tp)

    def init_spec(self, name: str) -> tuple[str, float]:
        if "norm" in name or name.startswith("ln_f"):
            return "ones", 0.0
        if name.endswith("attn.o.weight") or name.endswith("mlp.down.weight"):
            return "normal", self.cfg.init_std / math.sqrt(2 * self.cfg.n_layer)
        return "normal", self.cfg.init_std

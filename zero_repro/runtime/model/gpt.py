"""GPT-2-like language model (nanoGPT shape) with Megatron tensor parallelism: the model the
paper's experiments train (§10.1, "GPT-2 like transformer based models").

Pre-LN blocks, learned position embedding, causal self-attention, GELU MLP of width 4h, final
LayerNorm, LM head tied to the vocabulary-parallel token embedding; Ψ = 12·l·h² + 13·l·h +
(V + s)·h + 2h for the padded vocabulary V (``flops.param_count``). TP degree t: QKV and MLP-in
column-parallel, attention-out and MLP-out row-parallel, vocabulary-parallel embedding and
cross entropy. The model knows nothing of ZeRO: checkpointing and stage-3 gathering wrap
``model.blocks`` (``Block``: ``x -> x``) from outside.

Invariants: padded vocabulary rows (``padded_vocab``) start at zero, their logits are masked in
the loss, so their gradient is exactly zero and they stay zero (compare or sample from the first
``vocab_size`` columns only); initialisation is TP-consistent (each full tensor drawn from a
generator seeded by (seed, parameter name), each rank keeps its slice: any TP degree trains the
same model); QKV is head-major ([head, (q, k, v), head_dim]) so a TP slice is whole heads.
``init_on="device"`` draws each full tensor with a generator on the parameters' device instead
(the same model for every TP degree of that device type, not the CPU draw's values).
"""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from zero_repro.config import ModelConfig
from zero_repro.runtime.comm import comm
from zero_repro.runtime.model.decoder import (  # noqa: F401 (re-exported: the families' API)
    Decoder, causal_attention, gather_full_state, remember_names, shard_full_state)
from zero_repro.runtime.model.tp import (ColumnParallelLinear, RowParallelLinear,
                                         VocabParallelEmbedding, copy_to_tp)

log = logging.getLogger(__name__)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, group: comm.Group, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        if cfg.n_head % group.size:
            raise ValueError(f"TP size {group.size} does not divide n_head={cfg.n_head}")
        self.n_head_local = cfg.n_head // group.size
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = ColumnParallelLinear(cfg.n_embd, 3 * cfg.n_embd, group, bias=cfg.bias, **kw)
        self.proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, group, bias=cfg.bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, self.n_head_local, 3, self.head_dim)
        q, k, v = (u.transpose(1, 2) for u in qkv.unbind(dim=3))  # (B, nh/tp, T, hd)
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, t, self.n_head_local * self.head_dim)  # (B, T, h/tp)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, group: comm.Group, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, group, bias=cfg.bias, **kw)
        self.proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, group, bias=cfg.bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # fc out: (B, T, 4h/tp)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)). ``block(x) -> x``."""

    def __init__(self, cfg: ModelConfig, group: comm.Group, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, **kw)
        self.attn = CausalSelfAttention(cfg, group, **kw)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, **kw)
        self.mlp = MLP(cfg, group, **kw)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT(Decoder):
    VOCAB_ROWS = ("wte.weight",)

    def __init__(self, cfg: ModelConfig, tp_group: comm.Group | None = None, device=None,
                 dtype=None, seed: int = 0, init_on: str = "cpu"):
        super().__init__(cfg, tp_group)
        group = self.tp_group
        if cfg.dropout > 0 and group.size > 1:
            # dropout inside a TP region needs per-rank RNG streams (Megatron's RNG tracker)
            raise ValueError("model.dropout > 0 with parallel.tp > 1 is not supported: set "
                             "model.dropout=0 (the paper's throughput/memory runs need none)")
        kw = dict(device=device, dtype=dtype)
        self.wte = VocabParallelEmbedding(self.vocab_padded, cfg.n_embd, group, **kw)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd, **kw)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, group, **kw) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, **kw)
        log.debug("GPT %s: %d layers x %d, tp %d, padded vocab %d", cfg.name, cfg.n_layer,
                  cfg.n_embd, group.size, self.vocab_padded)
        self.finish(device, seed, init_on)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, h)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # tied LM head = column-parallel linear with the embedding's vocabulary slice
        return self.wte.head(copy_to_tp(self.ln_f(x), self.tp_group))  # (B, T, V_pad/tp)

    def init_spec(self, name: str) -> tuple[str, float]:
        if name.endswith("bias"):
            return "zeros", 0.0
        if ".ln_" in name or name.startswith("ln_f"):
            return "ones", 0.0
        if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
            # GPT-2: two residual adds per block, so scale by 1/sqrt(2·n_layer)
            return "normal", self.cfg.init_std / math.sqrt(2 * self.cfg.n_layer)
        return "normal", self.cfg.init_std

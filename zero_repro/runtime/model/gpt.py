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
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from zero_repro.config import ModelConfig, padded_vocab
from zero_repro.runtime.comm import comm
from zero_repro.runtime.model.tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                 copy_to_tp, vocab_parallel_cross_entropy)

log = logging.getLogger(__name__)


def _resolve_group(tp_group: comm.Group | None) -> comm.Group:
    return tp_group if tp_group is not None else comm.single_group("tp", comm.CommLedger())


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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     dropout_p: float) -> torch.Tensor:
    """Causal fused attention (B, nh, T, hd). On ``meta`` tensors (the paper-scale dry run,
    ``zero_repro.scale.dryrun``) ``F.scaled_dot_product_attention`` would take its math path, which
    materialises the s² scores; PyTorch chooses the kernel by device above the dispatcher
    (``sdp_utils.cpp``), so the dry run calls the kernel a CUDA GPU runs instead: the
    memory-efficient one, the choice on the paper's V100s (sm70; flash attention needs sm80+),
    which saves the output and an fp32 log-sum-exp of B·nh·T for backward."""
    if q.is_meta:
        need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, need_lse, dropout_p, True)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


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


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_group: comm.Group | None = None, device=None,
                 dtype=None, seed: int = 0, init_on: str = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.tp_group = group = _resolve_group(tp_group)
        if cfg.dropout > 0 and group.size > 1:
            # dropout inside a TP region needs per-rank RNG streams (Megatron's RNG tracker)
            raise ValueError("model.dropout > 0 with parallel.tp > 1 is not supported: set "
                             "model.dropout=0 (the paper's throughput/memory runs need none)")
        kw = dict(device=device, dtype=dtype)
        self.vocab_padded = padded_vocab(cfg, group.size)
        self.wte = VocabParallelEmbedding(self.vocab_padded, cfg.n_embd, group, **kw)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd, **kw)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, group, **kw) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, **kw)
        log.debug("GPT %s: %d layers x %d, tp %d, padded vocab %d", cfg.name, cfg.n_layer,
                  cfg.n_embd, group.size, self.vocab_padded)
        remember_names(self)
        if torch.device(device or "cpu").type != "meta":
            self.init_weights(seed, on=init_on)

    # ---------------------------------------------------------------- forward
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, T) -> (logits_local (B, T, V_pad/tp), mean loss or None)."""
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds model.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        # tied LM head = column-parallel linear with the embedding's vocabulary slice
        x = copy_to_tp(x, self.tp_group)
        logits = self.wte.head(x)  # (B, T, V_pad/tp)
        if targets is None:
            return logits, None
        loss = vocab_parallel_cross_entropy(logits.view(b * t, -1), targets.reshape(b * t),
                                            self.tp_group, vocab_size=self.cfg.vocab_size)
        return logits, loss

    # ---------------------------------------------------------------- side tables
    def tp_partition_dims(self) -> dict[str, int | None]:
        """Parameter name -> dimension split over TP, or None if replicated on every TP rank."""
        dims: dict[str, int | None] = {}
        for mname, mod in self.named_modules():
            table = getattr(type(mod), "PARTITION_DIMS", {})
            for pname, _ in mod.named_parameters(recurse=False):
                dims[f"{mname}.{pname}" if mname else pname] = table.get(pname)
        return dims

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape in the TP=1 model (vocab padded for TP=1)."""
        dims, t = self.tp_partition_dims(), self.tp_group.size
        out = {}
        for name, p in self.named_parameters():
            shape = list(p.shape)
            if dims[name] is not None:
                shape[dims[name]] *= t
            if name == "wte.weight":
                shape[0] = padded_vocab(self.cfg, 1)
            out[name] = tuple(shape)
        return out

    # ---------------------------------------------------------------- init
    def _init_spec(self, name: str) -> tuple[str, float]:
        """(kind, std) for the full tensor of parameter ``name``."""
        if name.endswith("bias"):
            return "zeros", 0.0
        if ".ln_" in name or name.startswith("ln_f"):
            return "ones", 0.0
        if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
            # GPT-2: two residual adds per block, so scale by 1/sqrt(2·n_layer)
            return "normal", self.cfg.init_std / math.sqrt(2 * self.cfg.n_layer)
        return "normal", self.cfg.init_std

    def init_weights(self, seed: int = 0, on: str = "cpu", only=None) -> None:
        """Fill every parameter (``only``: those of these tensors) with this rank's slice of
        the TP=1 model's tensor for ``seed``, drawn on the CPU (``on="cpu"``) or on the
        parameter's device (``on="device"``); see ``init_parameters``."""
        init_parameters(self, seed, on, only, vocab_rows=("wte.weight",))


def remember_names(model: nn.Module) -> None:
    """Record each parameter's name as the model was built, by (owning module, attribute): the
    name its initial value is drawn for, whatever wraps the modules later (activation
    checkpointing renames ``blocks.3.x`` to ``blocks.3.block.x``) or replaces the parameter
    objects (``to_empty``)."""
    model._built_names = {(id(m), pn): f"{mn}.{pn}" if mn else pn
                          for mn, m in model.named_modules()
                          for pn, _ in m.named_parameters(recurse=False)}


def _named_as_built(model: nn.Module):
    """(current name, name as built, parameter) of every parameter (``remember_names``)."""
    built = getattr(model, "_built_names", {})
    for mn, m in model.named_modules():
        for pn, p in m.named_parameters(recurse=False):
            cur = f"{mn}.{pn}" if mn else pn
            yield cur, built.get((id(m), pn), cur), p


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, on: str, only=None,
                    vocab_rows: tuple[str, ...] = ()) -> None:
    """TP-consistent initialisation of a GPT-family model: each parameter (``only``: those
    among these tensors, by identity) gets this TP rank's slice of its full (TP=1) tensor,
    drawn from a generator seeded by (``seed``, its name as built: ``remember_names``);
    ``vocab_rows`` the tables whose padded rows stay zero. Parameters without data (meta,
    fake: dry runs) are skipped. The same values for any TP degree, stage, DP size and order
    of calls: partitioned construction (``runtime.zero.build_init``) fills one unit at a time."""
    if on not in ("cpu", "device"):
        raise ValueError(f"init on {on!r}: use 'cpu' or 'device'")
    from torch._subclasses.fake_tensor import is_fake

    dims, full_shapes = model.tp_partition_dims(), model.full_shapes()
    t, r = model.tp_group.size, model.tp_group.rank
    wanted = None if only is None else {id(x) for x in only}
    seen = set()
    for cur, name, p in _named_as_built(model):
        if id(p) in seen or (wanted is not None and id(p) not in wanted) or p.is_meta \
                or is_fake(p):
            continue  # nothing to fill (dry runs), or a tied parameter filled already
        seen.add(id(p))
        full = _full_init(name, full_shapes[cur], *model._init_spec(name), seed,
                          n_real_rows=model.cfg.vocab_size if name in vocab_rows else None,
                          device=p.device if on == "device" else "cpu")
        p.copy_(_slice(full, dims[cur], r, t, p.shape).to(device=p.device, dtype=p.dtype))


def _name_seed(seed: int, name: str) -> int:
    # crc32 is stable across processes and Python versions (hash() is salted)
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _full_init(name, shape, kind, std, seed, n_real_rows=None, device="cpu") -> torch.Tensor:
    if kind == "zeros":
        return torch.zeros(shape, device=device)
    if kind == "ones":
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device).manual_seed(_name_seed(seed, name))
    rows = shape[0] if n_real_rows is None else n_real_rows
    full = torch.zeros(shape, device=device)
    # draw only the real rows, so the values do not depend on the padding of any TP degree
    full[:rows].normal_(0.0, std, generator=gen)
    return full


def _slice(full: torch.Tensor, dim: int | None, rank: int, tp: int, local_shape) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim``, zero-padding ``dim`` to local*tp first."""
    if dim is None:
        return full
    k = local_shape[dim]
    need = k * tp
    if full.shape[dim] < need:
        pad_shape = list(full.shape)
        pad_shape[dim] = need - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    return full.narrow(dim, rank * k, k)


# -------------------------------------------------------------------- TP state conversion
def gather_full_state(model: GPT, tp_group: comm.Group | None = None, grads: bool = False
                      ) -> dict[str, torch.Tensor]:
    """Rebuild the TP=1 parameters (or their gradients, ``grads=True``) from the TP shards.

    Every TP rank gets the full dict (all-gathers over ``tp_group``, default the model's). The
    token embedding is cut to the TP=1 padded vocabulary (rows beyond vocab_size are padding).
    Missing gradients come back as zeros.
    """
    group = tp_group if tp_group is not None else model.tp_group
    dims, full_shapes = model.tp_partition_dims(), model.full_shapes()
    out = {}
    for name, p in model.named_parameters():
        x = p.grad if grads else p
        x = torch.zeros_like(p) if x is None else x.detach()
        d = dims[name]
        if d is not None and group.size > 1:
            moved = x.movedim(d, 0).contiguous()
            buf = torch.empty((group.size,) + tuple(moved.shape), dtype=x.dtype, device=x.device)
            comm.all_gather_into(buf.view(-1), moved.view(-1), group)
            x = buf.flatten(0, 1).movedim(0, d)
        if d is not None:
            x = x.narrow(d, 0, full_shapes[name][d])
        out[name] = x.clone()
    return out


def shard_full_state(full: dict[str, torch.Tensor], tp_rank: int, tp: int,
                     dims: dict[str, int | None],
                     shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """Inverse of ``gather_full_state``: this TP rank's slice of every full tensor.

    ``shapes`` (name -> local shape, e.g. from the TP=k model's named_parameters) lets a
    dimension be zero-padded to local·tp first (the TP=k padded vocabulary); without it each
    split dimension must divide by ``tp``.
    """
    out = {}
    for name, x in full.items():
        d = dims[name]
        if d is None:
            out[name] = x.clone()
            continue
        local = list(shapes[name]) if shapes is not None else None
        if local is None:
            if x.shape[d] % tp:
                raise ValueError(f"{name}: dim {d} of size {x.shape[d]} is not divisible by "
                                 f"tp={tp}; pass shapes= to pad it")
            local = list(x.shape)
            local[d] //= tp
        out[name] = _slice(x, d, tp_rank, tp, local).clone()
    return out

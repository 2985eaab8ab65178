"""The decoder both model families share (GPT-2-like ``gpt``, Llama-shaped ``llama``; paper §10.1
trains GPT-2-like models, Megatron-LM's tensor parallelism inside them): token embedding ->
``blocks`` (an ``nn.ModuleList``, ``block(x) -> x``) -> final norm -> vocabulary-parallel head ->
vocabulary-parallel cross entropy, and what a TP model needs beside its forward.

A family subclasses ``Decoder`` with its blocks and three answers: ``embed(idx)`` (B, T) -> (B,
T, h), ``logits(x)`` (B, T, h) -> (B, T, V_pad/t), ``init_spec(name)`` -> (kind, std) of a
parameter's full tensor, and ``VOCAB_ROWS`` (parameters whose first dimension is the padded
vocabulary). Shared here: the forward and its loss, the side tables ``tp_partition_dims``
(declared per layer class in ``PARTITION_DIMS``) and ``full_shapes`` (the TP = 1 shapes),
TP-consistent initialisation (each full tensor drawn from a generator seeded by (seed, the
parameter's name as built), each rank keeps its slice: any TP degree, stage or unit order gives
the same model), the fused causal attention the families call, and the TP state conversion
(``gather_full_state`` / ``shard_full_state``). The model knows nothing of ZeRO.
"""
from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from zero_repro.config import ModelConfig, padded_vocab
from zero_repro.runtime.comm import comm
from zero_repro.runtime.model.tp import vocab_parallel_cross_entropy


def resolve_group(tp_group: comm.Group | None) -> comm.Group:
    """The TP group, or a group of one for a single process."""
    return tp_group if tp_group is not None else comm.single_group("tp", comm.CommLedger())


class Decoder(nn.Module):
    """Embedding -> blocks -> norm + head -> loss, over a TP group (module docstring)."""

    VOCAB_ROWS: tuple[str, ...] = ()
    blocks: nn.ModuleList

    def __init__(self, cfg: ModelConfig, tp_group: comm.Group | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp_group = resolve_group(tp_group)
        self.vocab_padded = padded_vocab(cfg, self.tp_group.size)

    def finish(self, device, seed: int, init_on: str) -> None:
        """End of a family's ``__init__``: the names as built, the weights unless on meta."""
        remember_names(self)
        if torch.device(device or "cpu").type != "meta":
            self.init_weights(seed, on=init_on)

    # ---------------------------------------------------------------- forward
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, T) -> (logits_local (B, T, V_pad/tp), mean loss or None)."""
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds model.seq_len={self.cfg.seq_len}")
        x = self.embed(idx)  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        logits = self.logits(x)  # (B, T, V_pad/tp)
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
            if name in self.VOCAB_ROWS:
                shape[0] = padded_vocab(self.cfg, 1)
            out[name] = tuple(shape)
        return out

    # ---------------------------------------------------------------- init
    def init_spec(self, name: str) -> tuple[str, float]:
        """(kind, std) of the full tensor of parameter ``name``: kind zeros | ones | normal."""
        raise NotImplementedError

    def init_weights(self, seed: int = 0, on: str = "cpu", only=None) -> None:
        """Fill every parameter (``only``: those of these tensors) with this rank's slice of
        the TP=1 model's tensor for ``seed``, drawn on the CPU (``on="cpu"``) or on the
        parameter's device (``on="device"``); see ``init_parameters``."""
        init_parameters(self, seed, on, only, vocab_rows=self.VOCAB_ROWS)


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
def init_parameters(model: "Decoder", seed: int, on: str, only=None,
                    vocab_rows: tuple[str, ...] = ()) -> None:
    """TP-consistent initialisation: each parameter (``only``: those among these tensors, by
    identity) gets this TP rank's slice of its full (TP=1) tensor, drawn from a generator
    seeded by (``seed``, its name as built: ``remember_names``) with the family's
    ``init_spec``; ``vocab_rows`` the tables whose padded rows stay zero. Parameters without
    data (meta, fake: dry runs) are skipped. The same values for any TP degree, stage, DP size
    and order of calls: partitioned construction (``runtime.zero.build_init``) fills one unit
    at a time."""
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
        full = _full_init(name, full_shapes[cur], *model.init_spec(name), seed,
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
def gather_full_state(model: "Decoder", tp_group: comm.Group | None = None, grads: bool = False
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

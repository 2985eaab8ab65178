"""Your own ``torch.optim.Optimizer`` on this rank's shard (paper §5.1, P_os: the optimizer holds
the states of its 1/N_d of the parameters only), ``TorchShardOptimizer``.

``build_strategy(..., optimizer=...)`` takes either a callable ``make(named)`` or an optimizer
already built on the model's parameters (``torch.optim.AdamW(model.parameters())``, before any
step). ``make`` is called once with ``named`` = the model's own trainable (name, parameter)
pairs, with their real shapes, so recipes that group by shape (``p.dim() >= 2`` gets weight
decay: nanoGPT, timm) or by name (biases and norms: Hugging Face) give the groups they give on
the unwrapped model. The runtime then swaps each group's parameters for their *parts* (DeepSpeed's
ZeRO does the same swap into its flat fp32 partitions, stage_1_and_2.py): a part is a 1-D
``nn.Parameter`` viewing the run of this rank's fp32 shard that holds elements of one parameter
within one bucket (the fp32 master; the training parameters themselves in fp32); a parameter
spanning several buckets has several parts in its group, one this rank holds none of has none.
Frozen parameters in a group are dropped (no gradient: torch skips them too); a parameter in no
group is not updated, as in torch. An optimizer whose update is elementwise (SGD, Adam(W),
Adagrad, RMSprop, Lion...) updates exactly what it would on the full parameters; one whose
update reads a parameter's shape (Shampoo, Muon) does not fit a flat shard (DeepSpeed's ZeRO has
the same contract).

Step: the gradient chunks (reduced, loss-scaled) become the parts' ``.grad`` in fp32 multiplied
by unscale × clip (fp32 training: the chunks themselves, scaled in place; otherwise one fp32
copy of the shard, 4Ψ/N_d bytes while the step runs, freed after: what DeepSpeed's stage 1-2
optimizers hold at their step), ``optimizer.step()`` runs, the updated master is cast into the
training-dtype chunks and each chunk is handed on (``on_chunk``). Memory: master 4Ψ/N_d (mixed
precision), the optimizer's own states (SGD momentum 4Ψ/N_d, Adam 8Ψ/N_d), the step's fp32
gradients. The state dict keeps every per-element state as one shard-long tensor per key (so
a checkpoint reshards like the built-in AdamW's), the scalar states and the groups'
hyperparameters.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

Factory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]
OptimizerArg = Factory | torch.optim.Optimizer


class TorchShardOptimizer:
    """``optimizer`` (a factory or a built optimizer, module docstring) over the shard made of
    ``chunks`` = [(offset, length)]; ``parts`` = [(name, shard offset, length)] in shard order
    (``Strategy._parts``); ``named`` / ``frozen``: the model's trainable and frozen (name,
    parameter) pairs."""

    def __init__(self, optimizer: OptimizerArg, chunks: Sequence[tuple[int, int]],
                 lp_chunks: Sequence[torch.Tensor], keep_master: bool,
                 parts: Sequence[tuple[str, int, int]],
                 named: Sequence[tuple[str, nn.Parameter]],
                 frozen: Sequence[tuple[str, nn.Parameter]] = (),
                 device: torch.device | None = None):
        self.chunks = list(chunks)
        self.numel = sum(n for _, n in self.chunks)
        dev = device if device is not None else \
            lp_chunks[0].device if len(lp_chunks) else torch.device("cpu")
        self.device = dev
        self.master = torch.zeros(self.numel, dtype=torch.float32, device=dev) if keep_master \
            else None
        if self.master is not None:
            with torch.no_grad():
                for (off, n), p in zip(self.chunks, lp_chunks):
                    self.master[off:off + n].copy_(p)
        self.lp_chunks = list(lp_chunks)
        self.parts = list(parts)
        self.params = [nn.Parameter(self._shard_view(off, n)) for _, off, n in self.parts]
        self.optimizer = _built(optimizer, named)
        self._swap_in_parts(named, frozen)
        self.step_count = 0
        self.step_bytes = 0  # the step's fp32 gradient copy, at its peak

    def _swap_in_parts(self, named, frozen) -> None:
        """Each group's model parameters replaced by their parts on this rank (in place: a
        scheduler built on the optimizer keeps working)."""
        name_of = {id(p): n for n, p in named}
        frozen_ids = {id(p) for _, p in frozen}
        parts_of: dict[str, list[nn.Parameter]] = {}
        for (name, _, _), part in zip(self.parts, self.params):
            parts_of.setdefault(name, []).append(part)
        for group in self.optimizer.param_groups:
            new, names = [], []
            for p in group["params"]:
                if id(p) in frozen_ids:
                    continue
                name = name_of.get(id(p))
                if name is None:
                    raise ValueError(
                        f"optimizer=: the optimizer holds a {tuple(p.shape)} tensor that is not "
                        f"a trainable parameter of the wrapped model; build it from the model's "
                        f"parameters (or the (name, parameter) pairs passed to the callable)")
                new += parts_of.get(name, [])
                names += [name] * len(parts_of.get(name, []))
            group["params"] = new
            if "param_names" in group:
                group["param_names"] = names

    def _shard_view(self, off: int, n: int) -> torch.Tensor:
        """Elements [off, off + n) of the fp32 shard (master, or the lp chunks in fp32), which
        lie in one chunk."""
        for i, (c0, cn) in enumerate(self.chunks):
            if c0 <= off and off + n <= c0 + cn:
                return self.master_chunk(i, self.lp_chunks[i])[off - c0:off - c0 + n]
        raise ValueError(f"part [{off}, {off + n}) does not lie in one chunk of the shard")

    def master_chunk(self, i: int, lp_chunk: torch.Tensor) -> torch.Tensor:
        off, n = self.chunks[i]
        return lp_chunk if self.master is None else self.master[off:off + n]

    @torch.no_grad()
    def step(self, lp_chunks: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
             grad_mult, *_hyper, on_chunk: Callable[[int], None] | None = None,
             found_inf: torch.Tensor | None = None, **_kw) -> None:
        """One ``optimizer.step()`` with gradients ``grads`` × ``grad_mult`` (a float or a
        device scalar; None gradients: zero); the optimizer's own hyperparameters apply (not
        ``train.lr`` and the rest). ``found_inf`` (a device flag agreed by every rank): the
        step is skipped, nothing changes -- read on the host, one synchronisation: a torch
        optimizer cannot skip on the device (the built-in AdamW does)."""
        if found_inf is not None and bool(found_inf.item()):
            for i in range(len(lp_chunks)):
                if on_chunk is not None:
                    on_chunk(i)
            return
        self.step_count += 1
        flat = self._grad_shard(grads, grad_mult)
        for p, (_, off, n) in zip(self.params, self.parts):
            p.grad = flat[off:off + n]
        try:
            self.optimizer.step()
        finally:
            for p in self.params:
                p.grad = None
            del flat
        for i, (lp, (off, n)) in enumerate(zip(lp_chunks, self.chunks)):
            if self.master is not None:
                lp.copy_(self.master[off:off + n])
            if on_chunk is not None:
                on_chunk(i)

    def _grad_shard(self, grads, grad_mult: float) -> torch.Tensor:
        """The shard's gradients in fp32 × ``grad_mult``: a view of the one gradient buffer
        where it already is one (fp32, contiguous chunks in shard order), else a copy."""
        base = _common_base(grads, self.chunks)
        if base is not None and base.dtype == torch.float32:
            if isinstance(grad_mult, torch.Tensor) or grad_mult != 1.0:
                base.mul_(grad_mult)
            return base
        flat = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self.step_bytes = max(self.step_bytes, flat.numel() * 4)
        for (off, n), g in zip(self.chunks, grads):
            if g is not None:
                flat[off:off + n].copy_(g.reshape(-1)).mul_(grad_mult)
        return flat

    # ------------------------------------------------------------------ state
    def state_keys(self) -> list[str]:
        """Per-element state names (tensors as long as their part), sorted."""
        keys = set()
        for p in self.params:
            for k, v in self.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.numel() == p.numel() and v.dim() == 1:
                    keys.add(k)
        return sorted(keys)

    def shard_state(self, key: str) -> torch.Tensor:
        """State ``key`` over the whole shard (zeros where a part has none yet)."""
        out = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for p, (_, off, n) in zip(self.params, self.parts):
            v = self.optimizer.state.get(p, {}).get(key)
            if v is not None:
                out[off:off + n].copy_(v)
        return out

    def scalars(self) -> dict[str, tuple[str, float]]:
        """Scalar states (e.g. Adam's ``step``) as (kind, value), from the first part."""
        for p in self.params:
            st = self.optimizer.state.get(p)
            if st:
                return {k: ("tensor", float(v)) if isinstance(v, torch.Tensor) else
                        ("number", float(v)) for k, v in st.items()
                        if not (isinstance(v, torch.Tensor) and v.numel() == p.numel()
                                and v.dim() == 1)}
        return {}

    def groups(self) -> list[dict]:
        """The param groups' hyperparameters (a scheduler may have changed ``lr``)."""
        return [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                for g in self.optimizer.param_groups]

    @torch.no_grad()
    def load(self, shard_states: dict[str, torch.Tensor], scalars: dict, groups: list[dict]
             ) -> None:
        """Install states from ``shard_states`` (key -> shard-long tensor), ``scalars`` and
        ``groups`` (as ``state_keys`` / ``shard_state``, ``scalars``, ``groups`` gave)."""
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(f"the state has {len(groups)} param groups, this optimizer "
                             f"{len(self.optimizer.param_groups)}")
        for g, saved in zip(self.optimizer.param_groups, groups):
            g.update(saved)
        for p, (_, off, n) in zip(self.params, self.parts):
            st = self.optimizer.state.setdefault(p, {})
            for k, v in shard_states.items():
                st[k] = v[off:off + n].clone()
            for k, (kind, value) in scalars.items():
                st[k] = torch.tensor(value, dtype=torch.float32) if kind == "tensor" else value

    def nbytes(self) -> dict[str, int]:
        state = sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                    for v in st.values() if isinstance(v, torch.Tensor) and v.dim() == 1)
        return {"master_fp32": 0 if self.master is None else self.master.numel() * 4,
                "optim_state": state, "optim_step": self.step_bytes}


def _built(optimizer: OptimizerArg, named) -> torch.optim.Optimizer:
    """The optimizer ``optimizer`` names: built by the callable from ``named``, or given."""
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    elif callable(optimizer):
        opt = optimizer(list(named))
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"optimizer=: the callable returned {type(opt).__name__}, not a "
                             f"torch.optim.Optimizer")
    else:
        raise ValueError(f"optimizer=: got a {type(optimizer).__name__}; pass a torch.optim."
                         f"Optimizer built on the model's parameters, or a callable "
                         f"(named) -> Optimizer")
    if any(opt.state.values()):
        raise ValueError(f"optimizer=: this {type(opt).__name__} has stepped already (it holds "
                         f"state); pass it before its first step: ZeRO moves it onto this "
                         f"rank's shard")
    return opt


def _common_base(grads, chunks) -> torch.Tensor | None:
    """The one 1-D tensor the gradient chunks are consecutive views of, laid out as the
    shard's chunks (M_D's contiguous gradient shard), else None."""
    if not grads or any(g is None for g in grads):
        return None
    first = grads[0]
    st = first.untyped_storage()._cdata
    start = first.storage_offset()
    for (off, n), g in zip(chunks, grads):
        if (g.untyped_storage()._cdata != st or g.storage_offset() != start + off
                or g.numel() != n or not g.is_contiguous()):
            return None
    total = sum(n for _, n in chunks)
    return first.as_strided((total,), (1,), start) if first.dim() else None

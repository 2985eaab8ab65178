"""Initialising a model built without storage (partitioned construction, paper §5.3: with P_p no
rank ever holds the whole model, not even while it is built; DeepSpeed's ``zero.Init``, FSDP2's
meta-device init + ``init_weights``).

A model created on the ``meta`` device has shapes and no data. The strategy places each group
(stages 0-2: the model; stage 3: one unit at a time) in its flat buffer on the device and calls
``init(named)`` with the (name, parameter) pairs just placed, which must fill them in place;
then stage 3 keeps this rank's chunks and frees the unit before the next. ``resolve_init``
picks it: the caller's; else, for a meta model on a real device, ``reset_init`` (each module
owning one of the parameters runs its ``reset_parameters()``, as ``nn.Linear``, ``nn.Embedding``
and ``nn.LayerNorm`` define it); else None (the parameters hold values: they are copied).
Buffers still on the meta device are materialised at the end and handed to ``init`` the same
way. Initial values must not depend on N_d, the stage or the unit order: an ``init`` that draws
a parameter from a generator seeded by its name (the project's GPT and Llama) gives the same
model at every stage and DP size.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Init = Callable[[list], None]


def resolve_init(model: nn.Module, init: Init | None, device: torch.device) -> Init | None:
    """The initialisation the build runs (module docstring)."""
    if init is not None:
        return init
    if device.type != "meta" and any(p.is_meta for p in model.parameters()):
        return reset_init(model)
    return None


def reset_init(model: nn.Module) -> Init:
    """``init`` running ``reset_parameters()`` of each module that owns one of the tensors it
    is given (ValueError naming the module where it has none)."""
    def init(named: list) -> None:
        done, given = set(), {id(t) for _, t in named}
        for name, _t in named:
            mname = name.rpartition(".")[0]
            mod = model.get_submodule(mname)
            if id(mod) in done:
                continue
            if any(id(q) not in given for q in mod.parameters(recurse=False)):
                raise ValueError(
                    f"module {mname!r} has parameters in two stage-3 units (a weight shared "
                    f"with another layer): its reset_parameters() would write a freed one; "
                    f"pass build_strategy(..., init=fn) filling the (name, tensor) pairs given")
            reset = getattr(mod, "reset_parameters", None) or \
                getattr(mod, "reset_running_stats", None)
            if not callable(reset):
                raise ValueError(
                    f"{name!r} was built on the meta device and its module "
                    f"{mname or type(model).__name__!r} ({type(mod).__name__}) has no "
                    f"reset_parameters(): pass build_strategy(..., init=fn), fn((name, tensor) "
                    f"pairs) filling them in place, or build the model with its values")
            with torch.no_grad():
                reset()
            done.add(id(mod))

    return init


def materialize_buffers(model: nn.Module, device: torch.device, init: Init) -> None:
    """Every buffer on the meta device: allocated on ``device`` and filled by ``init``."""
    if device.type == "meta":
        return
    named = []
    for mname, mod in model.named_modules():
        for bname, b in list(mod.named_buffers(recurse=False)):
            if b is not None and b.is_meta:
                new = torch.empty_like(b, device=device)
                mod._buffers[bname] = new
                named.append((f"{mname}.{bname}" if mname else bname, new))
    if named:
        init(named)

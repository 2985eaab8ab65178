"""Stage 3's units (paper §5.3, P_p: "the parameters of each layer are broadcast/gathered just
before they are needed"): which modules are gathered and freed as one, for any
``nn.Module``.

A unit is a module whose parameters are gathered together before its forward and freed
after it (FSDP2: one ``fully_shard`` per module). ``units`` (``build_strategy(units=...)``):

* None (default): the children of ``model.blocks`` when it is an ``nn.ModuleList``, else the
  children of the ``nn.ModuleList`` holding most parameters (a HuggingFace ``transformer.h``, an
  ``nn.TransformerEncoder``'s ``layers``, a user's ``layers``); none if the model has no list;
* a list of submodules of ``model``, in the order the forward runs them (prefetch follows it);
* a predicate ``module -> bool``: the outermost submodules it accepts, in module order.

Every parameter outside the units belongs to a *root* unit, one per top-level child of the
model (one named ``root`` for the model's own parameters), all gathered for the whole forward.
A parameter reachable from two units (weights shared between layers) goes to a root unit: no
unit may free what another still reads. Invariant: every parameter in exactly one unit;
Ψ_unit summed over units = Ψ. ``plan`` warns when one unit holds more than half of Ψ (stage 3
then holds that unit whole: little is saved over stage 2).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

log = logging.getLogger(__name__)

Units = Sequence[nn.Module] | Callable[[nn.Module], bool] | None


@dataclass
class UnitPlan:
    """One unit: its name (the module's qualified name, or a root's top-level child name),
    its module (None for the model's own parameters), its trainable and frozen (name,
    parameter) pairs in ``named_parameters`` order, and whether it is a per-layer unit (gathered
    around its own forward) or a root (gathered for the whole forward)."""

    name: str
    module: nn.Module | None
    params: list = field(default_factory=list)
    frozen: list = field(default_factory=list)
    layer: bool = False

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params + self.frozen)


def unit_modules(model: nn.Module, units: Units = None) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every per-layer unit, in forward order (module docstring).
    ValueError for a module that is not in ``model``, the model itself, or nested units."""
    qual = {id(m): n for n, m in model.named_modules()}
    if units is None:
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            blocks = _largest_list(model)
        return [(qual[id(m)], m) for m in blocks] if blocks is not None else []
    if callable(units) and not isinstance(units, nn.Module):
        chosen, inside = [], set()
        for n, m in model.named_modules():
            if m is model or any(n.startswith(o + ".") for o in inside):
                continue
            if units(m):
                chosen.append((n, m))
                inside.add(n)
        return chosen
    out = []
    for m in units:
        if not isinstance(m, nn.Module) or id(m) not in qual:
            raise ValueError(f"units: {type(m).__name__} is not a submodule of the model; pass "
                             f"modules of the model you wrap (e.g. list(model.layers))")
        if m is model:
            raise ValueError("units: the model itself is not a unit (its parameters outside "
                             "the units form the root units)")
        out.append((qual[id(m)], m))
    names = [n for n, _ in out]
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"units: {b!r} lies inside unit {a!r}; units must not nest")
    return out


def _largest_list(model: nn.Module) -> nn.ModuleList | None:
    best, size = None, 0
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = m, n
    return best


def plan(model: nn.Module, units: Units = None, warn: bool = True) -> list[UnitPlan]:
    """The units of ``model``: root units first (top-level child order), then the per-layer
    units in forward order; units without parameters are dropped."""
    layers = unit_modules(model, units)
    reach: dict[int, set[str]] = {}
    for name, mod in layers:
        for p in mod.parameters():
            reach.setdefault(id(p), set()).add(name)
    top = {}
    for child_name, child in model.named_children():
        for p in child.parameters():
            top.setdefault(id(p), child_name)
    by_name = {name: UnitPlan(name, mod, layer=True) for name, mod in layers}
    roots: dict[str, UnitPlan] = {}
    for n, p in model.named_parameters():
        owners = reach.get(id(p), set())
        if len(owners) == 1:
            u = by_name[next(iter(owners))]
        else:  # outside every unit, or shared by two: a root's
            rname = top.get(id(p), "root")
            u = roots.setdefault(rname, UnitPlan(rname, getattr(model, rname, None)))
        (u.params if p.requires_grad else u.frozen).append((n, p))
    out = [u for u in list(roots.values()) + [by_name[n] for n, _ in layers]
           if u.params or u.frozen]
    total = sum(u.numel for u in out)
    big = [u for u in out if total and u.numel > total / 2]
    if warn and big and len(out) > 1:
        log.warning("stage 3: unit %r holds %.0f%% of the model's parameters; it is gathered "
                    "whole, so stage 3 saves little over stage 2 (pass units= to split it, e.g. "
                    "units=list(model.layers))", big[0].name, 100 * big[0].numel / total)
    elif warn and total and not layers:
        log.warning("stage 3: no per-layer units found (no model.blocks, no nn.ModuleList): "
                    "the whole model is gathered at every forward; pass units= (modules or a "
                    "predicate) to gather it layer by layer")
    return out

"""ZeRO on a model that is not the project's, with your own torch optimizer (paper §5: any model
trains at every stage; ``runtime.zero.units``, ``runtime.zero.optim``, ``runtime.zero.guard``).

The foreign model has no ``blocks``: its layers are an ``nn.ModuleList`` named ``layers``; its
output head is tied to the embedding HuggingFace-style (``head.weight is emb.weight``: two
state-dict keys, one parameter), and it has frozen parameters (one at the root, one inside every
layer). Each distributed case trains it 5 steps on gloo at DP 2 and 3 against one process
training the same model on every rank's micro-batches with the same torch optimizer
(``torch.optim.SGD`` with momentum; ``AdamW`` with two param groups: no weight decay and twice
the learning rate for biases and norms): every parameter within 1e-5, read through
``strategy.full_state_dict()`` (which must load ``strict=True`` into a fresh model).
"""
from __future__ import annotations

import io
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.zero import build_strategy
from zero_repro.runtime.zero.guard import GradientElsewhereError, ParameterNotGatheredError
from zero_repro.runtime.zero.units import plan

VOCAB, D, LAYERS, SEQ, MICRO, STEPS, TOL = 96, 32, 3, 16, 2, 5, 1e-5


class Layer(nn.Module):
    def __init__(self, d: int, device=None):
        super().__init__()
        self.ln = nn.LayerNorm(d, device=device)
        self.fc1 = nn.Linear(d, 4 * d, device=device)
        self.fc2 = nn.Linear(4 * d, d, device=device)
        self.shift = nn.Parameter(torch.zeros(d, device=device), requires_grad=False)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.shift)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)))) + self.shift


class Foreign(nn.Module):
    """A user's model: ``layers`` (not ``blocks``), a tied head, frozen parameters."""

    def __init__(self, device=None):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D, device=device)
        self.layers = nn.ModuleList(Layer(D, device) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D, device=device)
        self.head = nn.Linear(D, VOCAB, bias=False, device=device)
        self.head.weight = self.emb.weight  # tied, HuggingFace-style
        self.gain = nn.Parameter(torch.ones(D, device=device), requires_grad=False)

    def reset_parameters(self) -> None:  # its own parameter (the default init calls it)
        nn.init.ones_(self.gain)

    def forward(self, idx, targets=None):
        x = self.emb(idx) * self.gain
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def fill(named) -> None:
    """A deterministic init by name (the same values at any stage, DP size, unit order)."""
    with torch.no_grad():
        for name, t in named:
            g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919)
            t.copy_(torch.randn(t.shape, generator=g) * 0.1 + (1.0 if "ln" in name or
                                                                  "norm" in name else 0.0))


def made() -> Foreign:
    m = Foreign()
    fill(list(m.named_parameters()))
    return m


def no_decay(name: str) -> bool:
    return name.endswith("bias") or ".ln." in name or name.startswith("norm")


OPTIMIZERS = {
    "sgd": lambda named: torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9),
    "adamw_groups": lambda named: torch.optim.AdamW(
        [{"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.1},
         {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0, "lr": 2e-3}],
        lr=1e-3),
}


def batch(step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=g),
            torch.randint(0, VOCAB, (rows, SEQ), generator=g))


def reference(opt_name: str, world: int) -> dict:
    model = made()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = OPTIMIZERS[opt_name](named)
    for step in range(STEPS):
        x, y = batch(step, MICRO * world)
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker(rank: int, world: int, cases: list) -> list:
    out = []
    for stage, opt_name, on_meta in cases:
        topo = Topology.build(1)
        model = Foreign(device="meta") if on_meta else made()
        zero = ZeroConfig(stage=stage, grad_clip=0.0, reduce_bucket_size=1500,
                          allgather_bucket_size=1500)
        strategy = build_strategy(model, topo, zero, TrainConfig(), ZeroRConfig(),
                                  optimizer=OPTIMIZERS[opt_name], device="cpu",
                                  init=fill if on_meta else None)
        for step in range(STEPS):
            x, y = batch(step, MICRO * world)
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = strategy(x[mine], y[mine])[1]
            strategy.backward(loss)
            strategy.step()
            strategy.zero_grad()
        full = strategy.full_state_dict()
        if rank == 0:
            fresh = Foreign()
            fresh.load_state_dict(full, strict=True)  # every key, tied ones included
        out.append(full)
        strategy.remove_hooks()
    return out


CASES = [(s, o, False) for s in (0, 1, 2, 3) for o in OPTIMIZERS] + [(3, "sgd", True)]


@pytest.mark.parametrize("world", [2, 3])
def test_foreign_model_with_torch_optimizers_matches_one_process(world):
    """Stages 0-3 × SGD / AdamW-with-groups on the foreign model equal one process's training
    within 1e-5 after 5 steps; a model built on the meta device and materialised unit by unit
    (stage 3) from a by-name init trains to the same values."""
    results = spawn(worker, world, CASES)[0]
    refs = {o: reference(o, world) for o in OPTIMIZERS}
    for (stage, opt_name, on_meta), full in zip(CASES, results):
        ref = refs[opt_name]
        assert set(full) == set(ref), (stage, opt_name)
        assert full["head.weight"].data_ptr() == full["emb.weight"].data_ptr()  # tied, once
        for k, v in ref.items():
            err = (full[k] - v).abs().max().item()
            assert err <= TOL, (stage, opt_name, on_meta, k, err)


def test_units_default_to_the_largest_module_list_and_warn_on_one_big_unit(caplog):
    m = made()
    units = plan(m)
    assert [u.name for u in units] == ["root", "emb", "norm", "layers.0", "layers.1",
                                       "layers.2"]
    assert [n for n, _ in units[1].params] == ["emb.weight"]  # the tied head: one parameter
    assert [n for n, _ in units[3].frozen] == ["layers.0.shift"]
    assert sum(u.numel for u in units) == sum(p.numel() for p in m.parameters())
    with caplog.at_level(logging.WARNING):
        plan(m, units=lambda mod: isinstance(mod, nn.ModuleList))
    assert "holds" in caplog.text and "units=" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        plan(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert "no per-layer units" in caplog.text
    with pytest.raises(ValueError, match="not a submodule"):
        plan(m, units=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="nest"):
        plan(m, units=[m.layers[0], m.layers[0].fc1])


def guard_worker(rank: int, world: int) -> dict:
    topo = Topology.build(1)
    model = Foreign(device="meta")  # default init: each module's reset_parameters()
    strategy = build_strategy(model, topo, ZeroConfig(stage=3), TrainConfig(), ZeroRConfig(),
                              device="cpu")
    seen = {}
    p = model.layers[1].fc1.weight
    for name, touch in (("sum", lambda: p.sum()), ("print", lambda: repr(p)),
                        ("state_dict", lambda: torch.save(model.state_dict(), io.BytesIO()))):
        try:
            touch()
            seen[name] = "no error"
        except ParameterNotGatheredError as e:
            seen[name] = str(e)
    seen["shape"] = tuple(p.shape)  # metadata stays readable
    with strategy.gathered():
        seen["gathered_sum"] = float(p.detach().sum())
        logits = model(batch(0, 2)[0])[0]  # a plain forward inside (generate())
        seen["logits_finite"] = bool(torch.isfinite(logits).all())
    x, y = batch(0, 2)
    strategy.backward(strategy(x, y)[1])
    for name, touch in (("sgd", lambda: torch.optim.SGD(model.parameters(), lr=0.1).step()),
                        ("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                        1.0))):
        try:
            touch()
            seen[name] = "no error"
        except GradientElsewhereError as e:
            seen[name] = str(e)
    strategy.step()
    strategy.zero_grad()
    seen["p_grad_after_step"] = p.grad is None
    try:
        _ = strategy.optimizer
    except AttributeError as e:
        seen["optimizer"] = str(e)
    return seen


def test_touching_a_freed_or_gradientless_parameter_raises_a_clear_error():
    seen = spawn(guard_worker, 2)[0]
    for key in ("sum", "print", "state_dict"):  # state_dict(): the first parameter it reads
        assert "strategy.gathered()" in seen[key] and "full_state_dict()" in seen[key], key
    assert "layers.1.fc1.weight" in seen["sum"] and "layers.1.fc1.weight" in seen["print"]
    assert seen["shape"] == (4 * D, D)
    assert seen["gathered_sum"] != 0.0 and seen["logits_finite"]
    for key in ("sgd", "clip"):
        assert "strategy.step()" in seen[key] and "grad_clip" in seen[key], key
    assert seen["p_grad_after_step"]
    assert "optimizer=" in seen["optimizer"]

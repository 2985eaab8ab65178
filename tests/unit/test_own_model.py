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

from tests import REPO
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


def probes_worker(rank: int, world: int) -> dict:
    """``guard_worker`` and ``gathered_worker`` on one pair of ranks (each builds its own
    models, Topology and strategy)."""
    return {"guard": guard_worker(rank, world), "gathered": gathered_worker(rank, world)}


@pytest.fixture(scope="module")
def world2_probes() -> dict:
    """Rank 0's ``probes_worker`` results: one spawn of two ranks for the guard test and the
    FSDP2 comparison, not two."""
    return spawn(probes_worker, 2)[0]


def test_touching_a_freed_or_gradientless_parameter_raises_a_clear_error(world2_probes):
    seen = world2_probes["guard"]
    for key in ("sum", "print", "state_dict"):  # state_dict(): the first parameter it reads
        assert "strategy.gathered()" in seen[key] and "full_state_dict()" in seen[key], key
    assert "layers.1.fc1.weight" in seen["sum"] and "layers.1.fc1.weight" in seen["print"]
    assert seen["shape"] == (4 * D, D)
    assert seen["gathered_sum"] != 0.0 and seen["logits_finite"]
    for key in ("sgd", "clip"):
        assert "strategy.step()" in seen[key] and "grad_clip" in seen[key], key
    assert seen["p_grad_after_step"]
    assert "optimizer=" in seen["optimizer"]


def stage2_model_states(rank: int, world: int, cfg_dict: dict) -> int:
    """Stage 2's model states on this rank, as its ledger counts them after the build."""
    from zero_repro import schema
    from zero_repro.runtime.train.build import build

    cfg = schema.to_config(cfg_dict)
    _, _, strategy = build(cfg, Topology.build(1), torch.device("cpu"))
    return strategy.memory_ledger().model_states()


def budget_worker(rank: int, world: int, stage2: dict, stage3: dict) -> tuple[int, dict]:
    """Both halves of the budget test in one spawn (six CPU ranks start once, not twice):
    stage 2's model states after its build, freed again, then stage 3's measured run
    (``lab.live_peak.measure``: the CPU allocator counts only the blocks made while it runs,
    so nothing stage 2 left behind is counted)."""
    import gc

    from zero_repro.lab.live_peak import measure

    states2 = stage2_model_states(rank, world, stage2)
    gc.collect()
    return states2, measure(rank, world, [stage3])[0]


def test_stage3_trains_a_model_larger_than_the_per_rank_budget_and_stage2_does_not():
    """A real run on 6 CPU ranks, every block counted (``lab.live_peak.measure``): a GPT
    whose fp32 parameters alone (4Ψ bytes) are the per-rank budget -- no rank could hold the
    model. Stage 3's live peak, its build included (partitioned construction: one unit whole
    at a time; building the model whole first held 4Ψ + the shards), stays under it; stage 2
    holds 4Ψ + 12Ψ/N_d of model states alone (its ledger after the build) and goes over."""
    from omegaconf import OmegaConf

    from zero_repro import config as C
    from zero_repro import schema
    from zero_repro.runtime.model import flops

    world, cfgs = 6, []
    for stage in (2, 3):
        cfg = C.Config()
        cfg.model = C.ModelConfig(name="budget", n_layer=32, n_embd=256, n_head=4, seq_len=32,
                                  vocab_size=512, vocab_pad_multiple=8)
        cfg.zero.stage, cfg.parallel.world_size, cfg.train.micro_batch_size = stage, world, 1
        cfg.zero.reduce_bucket_size = cfg.zero.allgather_bucket_size = 120_000
        cfg.zero_r = C.ZeroRConfig(name="custom", constant_buffers=True, contiguous_memory=True)
        cfgs.append(OmegaConf.to_container(OmegaConf.structured(cfg)))
    budget = 4 * flops.param_count(schema.to_config(cfgs[0]).model)  # the whole model's fp32 params
    results = spawn(budget_worker, world, *cfgs)
    for _, stage3 in results:
        assert stage3["build_peak"] < budget and stage3["live_peak"] < budget, (stage3, budget)
    assert all(states2 > budget for states2, _ in results), budget


def test_readme_example_is_the_example_file_and_runs_under_torchrun(tmp_path):
    """The README's "Use ZeRO on your own model" block is the example's code, and the example
    trains, checkpoints and exports at world 2 (torchrun, gloo)."""
    import os
    import subprocess
    import sys
    import textwrap

    repo = REPO
    example = open(os.path.join(repo, "zero_repro", "examples", "own_model.py")).read()
    start, end = "# --8<-- [start:own-model]\n", "    # --8<-- [end:own-model]"
    region = example[example.index(start) + len(start):example.index(end)]
    body = textwrap.dedent(region[:region.rindex("\n") + 1])  # the function's body, dedented
    readme = open(os.path.join(repo, "README.md")).read()
    assert "```python\n" + body + "```" in readme
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    p = subprocess.run([torchrun if os.path.exists(torchrun) else "torchrun", "--standalone",
                        "--nproc_per_node", "2", "-m", "zero_repro.examples.own_model"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": repo})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tensors" in p.stdout and "loss" in p.stdout
    assert (tmp_path / "own_model_ckpt" / "step_00000020" / "manifest.json").is_file()


def gathered_worker(rank: int, world: int) -> dict:
    """The most parameter elements held whole at once around each layer's forward: FSDP2 with
    one ``fully_shard`` per layer and the root, and this runtime's stage 3 (default units, no
    prefetch, as FSDP2 on CPU), same model, same batch; plus stage 3's own ledger peak."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    x, y = batch(0, MICRO * world)
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    fsdp = made()
    for layer in fsdp.layers:
        fully_shard(layer)
    fully_shard(fsdp)
    peaks = {"fsdp2": 0, "zero3": 0}

    def count(key, held):
        peaks[key] = max(peaks[key], held())

    fsdp_held = lambda: sum(p.numel() for p in fsdp.parameters()  # noqa: E731
                            if not isinstance(p, DTensor))
    for layer in fsdp.layers:
        layer.register_forward_pre_hook(lambda *a: count("fsdp2", fsdp_held))
        layer.register_forward_hook(lambda *a: count("fsdp2", fsdp_held))
    fsdp(x[mine], y[mine])[1].backward()

    model = made()
    topo = Topology.build(1)
    strategy = build_strategy(model, topo, ZeroConfig(stage=3, prefetch_blocks=0),
                              TrainConfig(), ZeroRConfig())
    units = strategy.params.units
    ours_held = lambda: sum(g.numel for u in units if u.state.value != "sharded"  # noqa: E731
                            for g, _ in u.parts)
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *a: count("zero3", ours_held), prepend=False)
        layer.register_forward_hook(lambda *a: count("zero3", ours_held))
    strategy.backward(strategy(x[mine], y[mine])[1])
    peaks["ledger_elements"] = strategy.memory_ledger().get("params_gathered") // 4
    peaks["total"] = sum(p.numel() for p in made().parameters())
    return peaks


def test_stage3_gathers_per_layer_as_much_as_fsdp2_per_block(world2_probes):
    """On the foreign model (no ``blocks``) stage 3 finds the layers by itself and holds what
    FSDP2 with one ``fully_shard`` per layer holds: the root and one layer (not the whole
    model); its ledger's gathered peak over forward and backward is the same."""
    p = world2_probes["gathered"]
    assert p["zero3"] == p["fsdp2"] == p["ledger_elements"], p
    assert p["fsdp2"] < 0.45 * p["total"], p


def resume_worker(rank: int, world: int, root: str, phase: str, stage: int) -> dict | None:
    """``phase`` "save": 3 steps of SGD (momentum) at ``stage`` and a DCP checkpoint; "load":
    resume it (any stage / DP size) and train 2 more steps; the export of rank 0."""
    from zero_repro.runtime.train import checkpoint

    topo = Topology.build(1)
    model = made()
    zero = ZeroConfig(stage=stage, grad_clip=0.0, reduce_bucket_size=1500,
                      allgather_bucket_size=1500)
    strategy = build_strategy(model, topo, zero, TrainConfig(), ZeroRConfig(),
                              optimizer=OPTIMIZERS["sgd"])
    steps = range(3) if phase == "save" else range(3, 5)
    if phase == "load":
        checkpoint.load(checkpoint.latest(root), strategy, topo)
    for step in steps:
        x, y = batch(step, MICRO * world)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        strategy.backward(strategy(x[mine], y[mine])[1])
        strategy.step()
        strategy.zero_grad()
    if phase == "save":
        checkpoint.save(root, strategy, topo, 3)
        return None
    return strategy.full_state_dict()


def test_a_torch_optimizer_checkpoint_reshards_to_another_stage_and_dp_size(tmp_path):
    """SGD's momentum is a per-element state: saved at stage 3 on DP 2, resumed at stage 1 on
    DP 3, training goes on as one process whose batch grows from 2 to 3 micro-batches."""
    spawn(resume_worker, 2, str(tmp_path), "save", 3)
    full = spawn(resume_worker, 3, str(tmp_path), "load", 1)[0]
    model = made()
    opt = OPTIMIZERS["sgd"]([(n, p) for n, p in model.named_parameters() if p.requires_grad])
    for step in range(5):
        x, y = batch(step, MICRO * (2 if step < 3 else 3))
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    for k, v in model.state_dict().items():
        assert (full[k] - v).abs().max().item() <= TOL, k

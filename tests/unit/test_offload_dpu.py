"""ZeRO-Offload's delayed parameter update (Ren et al. 2021 §4.2; ``zero.offload_dpu``,
``runtime.zero.offload.HostAdamW.step_delayed``) against a reference that applies each update one
step late.

After ``offload_dpu_warmup`` = W plain steps, the host's update of step t runs on a thread while
step t+1's forward and backward run on the parameters published before it: the gradient of step
t >= W + 2 is taken at θ_{t-2} (step W + 1's at θ_W), and θ_t = AdamW(θ_{t-1}, g_t). The
reference is one process with torch's fused AdamW on an fp32 master, publishing the master before
each update instead of after it once the warm-up is over. Stages 1-3 at DP 2, fp32: every
parameter within 1e-5 after 6 steps (W = 2), read after the last delayed update has landed
(``full_parameters`` settles it); and the delayed run differs from the plain one (the delay
changes the arithmetic, on purpose).
"""
from __future__ import annotations

import pytest
import torch

from zero_repro.config import ModelConfig, TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model.gpt import GPT
from zero_repro.runtime.zero import build_strategy

CFG = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=128,
                  vocab_pad_multiple=8)
ROWS, SEED, STEPS, WARMUP, TOL = 4, 5, 6, 2, 1e-5
TRAIN = TrainConfig(micro_batch_size=ROWS // 2, lr=1e-2, eps=1e-6, weight_decay=0.1)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, CFG.vocab_size, (ROWS, CFG.seq_len), generator=g),
            torch.randint(0, CFG.vocab_size, (ROWS, CFG.seq_len), generator=g))


def worker(rank: int, world: int) -> dict:
    out = {}
    for stage in (1, 2, 3):
        for dpu in (True, False):
            topo = Topology.build(1)
            model = GPT(CFG, topo.tp_group)
            model.init_weights(SEED)
            zero = ZeroConfig(stage=stage, dtype="fp32", grad_clip=0.0, reduce_bucket_size=900,
                              allgather_bucket_size=900, offload_optimizer="cpu",
                              offload_dpu=dpu, offload_dpu_warmup=WARMUP)
            s = build_strategy(model, topo, zero, TRAIN, ZeroRConfig())
            rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
            pending = []
            for step in range(STEPS):
                x, y = batch(step)
                s.backward(s(x[rows], y[rows])[1])
                s.step()
                s.zero_grad()
                pending.append(s.opt._pending is not None)
            out[(stage, dpu)] = (s.full_parameters(), pending)
            s.remove_hooks()
    return out


def reference(delayed: bool) -> dict:
    model = GPT(CFG, None)
    model.init_weights(SEED)
    names = [n for n, _ in model.named_parameters()]
    master = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=TRAIN.lr, betas=(TRAIN.beta1, TRAIN.beta2),
                            eps=TRAIN.eps, weight_decay=TRAIN.weight_decay, fused=True)
    for step in range(STEPS):
        x, y = batch(step)
        model.zero_grad()
        model(x, y)[1].backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.detach().clone()
        before = [m.detach().clone() for m in master]
        opt.step()
        late = delayed and step + 1 > WARMUP  # this update lands at the next step
        with torch.no_grad():
            for p, src in zip(model.parameters(), before if late else master):
                p.copy_(src)
    return {n: m.detach().clone() for n, m in zip(names, master)}


@pytest.fixture(scope="module")
def runs():
    return spawn(worker, 2, timeout_s=240)[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_delayed_update_equals_its_one_step_late_reference(runs, stage):
    got, pending = runs[(stage, True)]
    assert pending == [False] * WARMUP + [True] * (STEPS - WARMUP)  # delayed after warm-up
    ref = reference(delayed=True)
    worst = max((got[n] - ref[n]).abs().max().item() for n in ref)
    assert worst <= TOL, (stage, worst)
    plain = reference(delayed=False)
    plain_got, plain_pending = runs[(stage, False)]
    assert not any(plain_pending)
    assert max((plain_got[n] - plain[n]).abs().max().item() for n in plain) <= TOL
    # the delay changes the result beyond the tolerance (the test can tell them apart)
    assert max((got[n] - plain[n]).abs().max().item() for n in plain) > 100 * TOL


def test_the_delayed_update_needs_the_optimizer_on_the_host():
    from zero_repro import config as C
    from zero_repro import validation
    cfg = C.Config(zero=C.ZeroConfig(stage=2, offload_dpu=True))
    with pytest.raises(ValueError, match="offload_optimizer=cpu"):
        validation.validate(cfg)

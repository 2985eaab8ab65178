"""The Llama-shaped model (runtime/model/llama.py): TP 2 / 4 and a 2x2 grid reproduce the TP=1
model's logits, loss and every gradient (gloo), with Megatron's all-reduce count; parameter
counts equal the released models'; FLOPs equal the counted matmuls; rotary positions are
relative; the TP rule for key/value heads; the public configs; the build picks the class."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from zero_repro import config as C
from zero_repro import schema
from zero_repro import validation
from zero_repro.config import ModelConfig, padded_vocab
from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model import flops, model_class
from zero_repro.runtime.model.gpt import GPT, gather_full_state, shard_full_state
from zero_repro.runtime.model.llama import Llama, Rotary, rotate

# 8 query heads, 4 kv heads (groups of 2): TP 2 and 4 split the groups; vocab 100 pads
# differently at every TP degree
CFG = ModelConfig(name="t", family="llama", n_layer=2, n_embd=64, n_head=8, n_kv_head=4,
                  ffn_hidden=96, seq_len=16, vocab_size=100, vocab_pad_multiple=8, bias=False)
SEED = 5
TOL = dict(atol=1e-5, rtol=1e-4)
# released parameter counts (Hugging Face model cards / safetensors index totals)
RELEASED = {"llama2_7b": 6_738_415_616, "llama2_13b": 13_015_864_320,
            "llama2_70b": 68_976_648_192, "llama3_8b": 8_030_261_248,
            "llama3_70b": 70_553_706_496}


def _batch(seed: int, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, CFG.vocab_size, (b, CFG.seq_len), generator=g),
            torch.randint(0, CFG.vocab_size, (b, CFG.seq_len), generator=g))


def _check_equivalence(group: comm.Group, ledger: comm.CommLedger, batch_seed: int) -> None:
    ref, model = Llama(CFG, seed=SEED), Llama(CFG, group, seed=SEED)
    ref_full = {n: p.detach() for n, p in ref.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shards = shard_full_state(ref_full, group.rank, group.size, model.tp_partition_dims(),
                              shapes)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), shards[n]), n
    idx, tgt = _batch(batch_seed)
    ref_logits, ref_loss = ref(idx, tgt)
    ref_loss.backward()
    ledger.reset()
    logits, loss = model(idx, tgt)
    # forward: embedding 1 + 2 per block (o, down) + 3 in the cross entropy
    fwd = ledger.counts[("all_reduce", "tp")].calls
    assert fwd == 1 + 2 * CFG.n_layer + 3, fwd
    loss.backward()
    # backward: 2 per block (fused qkv's and gate_up's input) + 1 for the LM head's input
    assert ledger.counts[("all_reduce", "tp")].calls - fwd == 2 * CFG.n_layer + 1
    parts = [torch.empty_like(logits) for _ in range(group.size)]
    comm.all_gather_list(parts, logits.detach().contiguous(), group)
    torch.testing.assert_close(torch.cat(parts, -1)[..., :CFG.vocab_size],
                               ref_logits.detach()[..., :CFG.vocab_size], **TOL)
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), **TOL)
    grads = gather_full_state(model, grads=True)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
    for name in ("tok_emb.weight", "lm_head.weight"):  # padding rows: zero, no gradient
        assert not gather_full_state(model)[name][CFG.vocab_size:].any()
        assert not grads[name][CFG.vocab_size:].any()


def _worker(rank: int, world: int) -> str:
    topo = Topology.build(tp=world)
    _check_equivalence(topo.tp_group, topo.ledger, batch_seed=3)
    if world == 4:
        grid = Topology.build(tp=2)
        _check_equivalence(grid.tp_group, grid.ledger, batch_seed=50 + grid.dp_rank)
        assert grid.ledger.volume(group_name="dp") == 0
    return "ok"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_matches_tp1(world):
    assert spawn(_worker, world) == ["ok"] * world


def test_reference_is_plain_attention():
    """TP 1 equals a direct, unfused computation: RMSNorm, rotary q/k, kv heads repeated to
    their query heads, softmax causal attention, SwiGLU, untied head."""
    m = Llama(CFG, seed=SEED)
    idx, tgt = _batch(1)
    p = dict(m.named_parameters())
    h, a, g = CFG.n_embd, CFG.n_head, CFG.n_kv_head
    d, rep = h // a, a // g
    x = p["tok_emb.weight"][idx]
    cos, sin = Rotary(d, CFG.rope_theta).tables(CFG.seq_len, "cpu", torch.float32)
    mask = torch.ones(CFG.seq_len, CFG.seq_len, dtype=torch.bool).tril()
    for i in range(CFG.n_layer):
        pre = f"blocks.{i}."
        u = F.rms_norm(x, (h,), p[pre + "attn_norm.weight"], CFG.norm_eps)
        w = p[pre + "attn.qkv.weight"].view(g, rep + 2, d, h)  # group-major rows
        q = torch.einsum("bth,gidh->btgid", u, w[:, :rep]).reshape(2, -1, a, d)
        k = torch.einsum("bth,gdh->btgd", u, w[:, rep])
        v = torch.einsum("bth,gdh->btgd", u, w[:, rep + 1])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = k[:, torch.arange(a) // rep], v[:, torch.arange(a) // rep]
        s = (q @ k.transpose(-1, -2) / d ** 0.5).masked_fill(~mask, float("-inf"))
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(2, -1, h)
        x = x + y @ p[pre + "attn.o.weight"].T
        u = F.rms_norm(x, (h,), p[pre + "mlp_norm.weight"], CFG.norm_eps)
        gu = (u @ p[pre + "mlp.gate_up.weight"].T).unflatten(-1, (-1, 2))
        x = x + (F.silu(gu[..., 0]) * gu[..., 1]) @ p[pre + "mlp.down.weight"].T
    x = F.rms_norm(x, (h,), p["ln_f.weight"], CFG.norm_eps)
    logits = x @ p["lm_head.weight"].T
    got, loss = m(idx, tgt)
    torch.testing.assert_close(got, logits, **TOL)
    want = F.cross_entropy(logits[..., :CFG.vocab_size].reshape(-1, CFG.vocab_size),
                           tgt.reshape(-1))
    torch.testing.assert_close(loss, want, **TOL)


def test_rotary_scores_depend_on_offset_only():
    rot = Rotary(8, 10000.0)
    cos, sin = rot.tables(12, "cpu", torch.float64)  # the angles are computed in fp32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, dtype=torch.float64, generator=g).expand(1, 1, 12, 8)
    k = torch.randn(8, dtype=torch.float64, generator=g).expand(1, 1, 12, 8)
    s = rotate(q, cos, sin)[0, 0] @ rotate(k, cos, sin)[0, 0].T  # (12, 12)
    for off in range(-3, 4):
        diag = torch.diagonal(s, off)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), atol=1e-5, rtol=1e-5)
    assert rot.tables(12, "cpu", torch.float64)[0] is cos  # made once, shared


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_public_shapes_have_released_param_counts(name):
    m = ModelConfig(**schema.model_conf(name))
    assert m.family == "llama" and flops.param_count(m) == RELEASED[name]
    model = Llama(m, device="meta", dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == RELEASED[name]
    for tp in (2, 8):
        g = comm.Group("tp", tuple(range(tp)), tp - 1, None, comm.CommLedger())
        shard = Llama(m, g, device="meta")
        assert sum(p.numel() for p in shard.parameters()) == \
            flops.param_count_per_tp_rank(m, tp), (name, tp)


def test_small_configs_validate():
    for name in ("llama_tiny", "llama_small"):
        cfg = C.Config(model=ModelConfig(**schema.model_conf(name)))
        cfg.parallel = C.ParallelConfig(world_size=4, tp=2)
        validation.validate(cfg)


class _Recompute(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize("recompute", [False, True])
def test_flops_formula_matches_counted_matmuls(recompute):
    cfg = dataclasses.replace(CFG, vocab_size=96)  # a multiple of the padding: V as built
    model = Llama(cfg, seed=0)
    if recompute:
        model.blocks = torch.nn.ModuleList(_Recompute(b) for b in model.blocks)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    with sdpa_kernel(SDPBackend.MATH), set_checkpoint_early_stop(False), \
            FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    assert counter.get_total_flops() == flops.flops_per_iteration_cfg(cfg, 3, recompute)


def test_shape_formula_reduces_to_gpt():
    for rc in (False, True):
        assert flops.flops_per_iteration_shape(4, 1024, 24, 2048, 50304, rc) == \
            pytest.approx(flops.flops_per_iteration(4, 1024, 24, 2048, 50304, rc), rel=1e-12)


def test_tp_rule_for_kv_heads_and_llama_fields():
    cfg = C.Config(model=CFG, parallel=C.ParallelConfig(world_size=8, tp=8))
    with pytest.raises(ValueError, match="does not divide model.n_kv_head=4"):
        validation.validate(cfg)
    for bad, match in [({"bias": True}, "no biases"), ({"n_kv_head": 3}, "n_kv_head=3"),
                       ({"family": "bert"}, "model.family"), ({"n_embd": 40, "n_head": 8},
                                                              "head size 5")]:
        with pytest.raises(ValueError, match=match):
            validation.validate(C.Config(model=dataclasses.replace(CFG, **bad)))


def test_ffn_width_rule():
    # Meta's rule without a multiplier: int(2*4h/3) rounded up to 256 (Llama 2 7B / 13B)
    for h, f in [(4096, 11008), (5120, 13824)]:
        assert C.ffn_width(ModelConfig(family="llama", n_embd=h, n_head=32, bias=False)) == f
    assert C.ffn_width(ModelConfig(n_embd=64)) == 256  # GPT: 4h


def test_model_class_and_meta_padding():
    assert model_class(CFG) is Llama and model_class(ModelConfig()) is GPT
    g = comm.Group("tp", (0, 1, 2, 3), 3, None, comm.CommLedger())
    m = Llama(CFG, g, device="meta")
    assert m.tok_emb.weight.shape[0] * 4 == padded_vocab(CFG, 4) == 128
    dims = m.tp_partition_dims()
    assert dims["blocks.0.attn.qkv.weight"] == 0 and dims["blocks.0.attn.o.weight"] == 1
    assert dims["blocks.0.mlp.gate_up.weight"] == 0 and dims["blocks.0.mlp.down.weight"] == 1
    assert dims["lm_head.weight"] == 0 and dims["ln_f.weight"] is None
    assert m.full_shapes()["lm_head.weight"] == (104, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch_and_saves_input_and_rstd(dtype):
    from zero_repro.runtime.model.llama import RMSNorm
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    norm = RMSNorm(16, 1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    g = torch.randn(3, 5, 16, dtype=dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norm(x)
    (y * g).sum().backward()
    xr = x.detach().float().requires_grad_(True)
    wr = norm.weight.detach().float().requires_grad_(True)
    yr = F.rms_norm(xr, (16,), wr, 1e-5)
    (yr * g.float()).sum().backward()
    tol = TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y.float(), yr, **tol)
    torch.testing.assert_close(x.grad.float(), xr.grad, **tol)
    torch.testing.assert_close(norm.weight.grad.float(), wr.grad, **tol)
    # what CUDA's fused kernel keeps: the input, the weight and an fp32 rstd per row
    assert [tuple(t.shape) for t in saved] == [(3, 5, 16), (16,), (3, 5, 1)]
    assert saved[2].dtype == torch.float32

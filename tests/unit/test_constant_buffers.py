"""C_B (paper §6.2): with constant-size buffers, the fused communication buffers a rank holds do
not grow with the model; without C_B the fused buffer grows with it (the paper's baseline: at
stage 2 one gradient bucket of the whole model, held in the flat gradient buffer that also holds
the shard; at stage 3 one of the largest unit, which grows with the block, not the depth).

Stage 1 keeps full gradients anyway and reduces each bucket inside them: its only buffers are
the transport's own (``held_bytes``: receive scratch, slots), constant with C_B; stages 2 and 3
keep two fused gradient buffers of R elements (without C_B one of the largest flat group).
"""
import torch

from zero_repro.config import ModelConfig, TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model.gpt import GPT
from zero_repro.runtime.model.flops import param_count
from zero_repro.runtime.zero import build_strategy

BUCKET = 20_000  # elements; far below either model's size so every buffer is at capacity


def _model_cfg(n_layer: int) -> ModelConfig:
    # same width, 4x the blocks: a stage-3 unit (one block) has the same size in both
    return ModelConfig(n_layer=n_layer, n_embd=64, n_head=4, seq_len=16, vocab_size=256,
                       vocab_pad_multiple=8)


def _buffers(rank, world, n_layer, stage, constant):
    topo = Topology.build(tp=1)
    torch.manual_seed(0)
    model = GPT(_model_cfg(n_layer), tp_group=topo.tp_group)
    zr = ZeroRConfig(name="custom", constant_buffers=constant, contiguous_memory=True)
    strat = build(model, topo, stage, zr)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(2):  # stage 3 reports the peak it has seen: run full steps first
        _, loss = strat.module(x, x)
        strat.backward(loss)
        strat.step()
        strat.zero_grad()
    led = strat.memory_ledger()
    padded = sum(g.partition.padded_numel for g in strat.groups)
    return (led.get("comm_buffers"), strat.transport.held_bytes(), led.get("grads"), padded)


def build(model, topo, stage, zr):
    zc = ZeroConfig(stage=stage, reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET)
    return build_strategy(model, topo, zc, TrainConfig(lr=1e-3), zr)


def _all(rank, world):
    out = {}
    for stage in (1, 2, 3):
        for constant in (True, False):
            for n_layer in (4, 16):
                out[(stage, constant, n_layer)] = _buffers(rank, world, n_layer, stage, constant)
    return out


def test_fused_buffers_constant_with_c_b_and_growing_without():
    small, large = param_count(_model_cfg(4)), param_count(_model_cfg(16))
    assert large > 3 * small  # the "4x" model (embeddings are shared, so a bit under 4x)
    res = spawn(_all, 2)
    for rank_res in res:
        for stage in (1, 2, 3):
            (a, held, _, _), (b, _, _, _) = rank_res[(stage, True, 4)], rank_res[(stage, True, 16)]
            assert a == b, f"stage {stage} with C_B: buffers grew with the model ({a} -> {b} B)"
            fused = 0 if stage == 1 else 2 * BUCKET * 4  # two fused buffers of R fp32 elements
            assert a - held == fused, f"stage {stage}: {a - held} B beside the transport's"
        # stage 2 without C_B: the gradient buffer of the whole model (its fused buffer), with
        # C_B the shard alone
        for n_layer in (4, 16):
            _, _, g_on, padded = rank_res[(2, True, n_layer)]
            _, _, g_off, padded_off = rank_res[(2, False, n_layer)]
            assert g_off == padded_off * 4 and g_on == padded * 4 // 2, (n_layer, g_on, g_off)
        # stage 3 without C_B: one fused buffer of the largest unit (a block or the root)
        (a, held, _, _), (b, _, _, _) = rank_res[(3, False, 4)], rank_res[(3, False, 16)]
        assert a == b and a - held > 2 * BUCKET * 4, (a, b)

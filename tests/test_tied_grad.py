"""Stage 2's split tied-embedding gradient (``zero.split_tied_grad``): the LM head's weight
gradient computed piece by piece straight into the fused buckets and reduce-scattered early,
the lookup's rows exchanged sparse; against the dense autograd path on the same model and batch.
(Training equivalence with AdamW: ``test_zero_equivalence.py``, configs with ``split``.)
"""
from __future__ import annotations

import pytest
import torch

from zero_repro.config import ModelConfig, TrainConfig, ZeroConfig
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model.gpt import GPT
from zero_repro.runtime.zero import build_strategy
from zero_repro.runtime.zero.buckets import matmul_flat_into

CFG = ModelConfig(n_layer=2, n_embd=48, n_head=4, seq_len=16, vocab_size=300,
                  vocab_pad_multiple=8)
MICRO = 3


def test_matmul_flat_into_is_the_slice_of_the_product():
    g = torch.Generator().manual_seed(0)
    a, x = torch.randn(20, 37, generator=g), torch.randn(20, 8, generator=g)
    want = (a.t() @ x).flatten() / 3
    # whole rows, partial rows at either end, a range inside one row, one element, everything
    for e0, e1 in [(0, 296), (8, 40), (3, 8), (3, 21), (5, 6), (9, 15), (16, 17), (290, 296),
                   (11, 283), (0, 5)]:
        dst = torch.full((e1 - e0,), float("nan"))
        matmul_flat_into(dst, a, x, e0, e1, 1 / 3)
        torch.testing.assert_close(dst, want[e0:e1], rtol=1e-5, atol=1e-6)


def _run(rank: int, world: int, bucket: int) -> dict:
    out = {}
    g = torch.Generator().manual_seed(11)
    idx = torch.randint(0, CFG.vocab_size, (world * MICRO, CFG.seq_len), generator=g)
    idx[:, :4] = 5  # repeated ids: a row's duplicates are summed
    tgt = torch.randint(0, CFG.vocab_size, (world * MICRO, CFG.seq_len), generator=g)
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    for split in (False, True):
        topo = Topology.build(1)
        model = GPT(CFG, topo.tp_group)
        model.init_weights(5)
        zero = ZeroConfig(stage=2, reduce_bucket_size=bucket, allgather_bucket_size=bucket,
                          grad_clip=0.0, split_tied_grad=split)
        strat = build_strategy(model, topo, zero, TrainConfig(micro_batch_size=MICRO))
        emb = strat.flat.slot_of[id(model.wte.weight)]
        pure = {b.index for b in strat.flat.partition.buckets
                if b.start >= emb.offset and min(b.end, strat.flat.partition.numel) <= emb.end}
        launched = []
        launch = strat._launch
        strat._launch = lambda b: (launched.append(b.index), launch(b))
        topo.ledger.reset()
        _, loss = strat(idx[mine], tgt[mine])
        strat.backward(loss)
        strat._wait_reductions()
        out[split] = {"shard": torch.cat([c.clone() for c in strat._grad_chunks()]),
                      "dense_grad": model.wte.weight.grad is not None,
                      "first": launched[:len(pure)],
                      "pure": pure, "dp": topo.ledger.volume("dp"), "loss": loss.item()}
        strat.step()
        strat.remove_hooks()
    return out


@pytest.mark.parametrize("world,bucket", [(2, 1000), (3, 999)])
def test_split_tied_grad_reduces_the_same_gradient_early(world, bucket):
    """Per rank: the reduced gradient shard equals the dense path's within fp32 rounding; no
    dense gradient reaches the tied weight; the buckets holding only embedding elements are
    the first reduce-scattered (right after the head's backward) instead of the last; the
    extra traffic is exactly the all-gather of every rank's B·s rows (ids + h values)."""
    results = spawn(_run, world, bucket)
    for rank, r in enumerate(results):
        dense, split = r[False], r[True]
        assert dense["loss"] == split["loss"]  # the same forward
        scale = dense["shard"].abs().max().item()
        diff = (dense["shard"] - split["shard"]).abs().max().item()
        assert diff <= 1e-6 * scale, f"rank {rank}: max |Δ grad| {diff:.3g} (scale {scale:.3g})"
        assert dense["dense_grad"] is False and split["dense_grad"] is False  # hooks drop it
        assert len(split["pure"]) >= 2
        assert not set(dense["first"]) & dense["pure"], dense  # dense: at the end of backward
        assert set(split["first"]) == split["pure"], split  # split: first of all
        rows = MICRO * CFG.seq_len
        assert split["dp"] - dense["dp"] == world * rows * (CFG.n_embd + 1)

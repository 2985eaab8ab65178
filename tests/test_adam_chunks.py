"""ShardAdamW: the chunk-by-chunk update equals torch's AdamW bit for bit, and the step's
transient fp32 gradient copies are made one chunk at a time (an up-front conversion of the whole
shard would hold 4Ψ/N_d uncounted bytes at the fp16 step)."""
from __future__ import annotations

import pytest
import torch

from zero_repro.scale.dryrun.tracer import ALLOC, FREE, AllocationTracer
from zero_repro.runtime.zero.adam import ShardAdamW, fused_available

SIZES = (1000, 3000, 500, 2500)  # four chunks of one shard


def _state(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
    grads = [[torch.randn(n, generator=gen).to(dtype) for n in SIZES] for _ in range(3)]
    chunks, off = [], 0
    for n in SIZES:
        chunks.append((off, n))
        off += n
    return params, grads, chunks


HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("with_callback", [False, True])
def test_chunkwise_step_equals_torch_adamw(fused, with_callback):
    if fused and not fused_available():
        pytest.skip("torch has no fused AdamW kernel")
    params, grads, chunks = _state(torch.float32)
    ours = [p.clone() for p in params]
    opt = ShardAdamW(chunks, ours, keep_master=False, fused=fused)
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    kw = dict(fused=True) if fused else dict(foreach=False)
    ref_opt = torch.optim.AdamW(ref, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"],
                                weight_decay=HP["weight_decay"], **kw)
    mult = 0.5  # an unscale/clip multiplier: forces the fp32 copy path
    for gs in grads:
        seen = []
        opt.step(ours, gs, mult, on_chunk=seen.append if with_callback else None, **HP)
        if with_callback:
            assert seen == list(range(len(SIZES)))
        for p, g in zip(ref, gs):
            p.grad = g * mult
        ref_opt.step()
    for a, b in zip(ours, ref):
        assert torch.equal(a, b.detach()), (a - b).abs().max()


def _fp32_step_transients(fused: bool) -> tuple[int, int]:
    """(peak bytes of storages allocated during one fp16 step, bytes of the largest chunk's
    fp32 copy)."""
    tracer = AllocationTracer()
    with tracer:  # the state is made under the tracer too, so only the step's own storages
        params, grads, chunks = _state(torch.float16)  # are new in the "step" phase
        opt = ShardAdamW(chunks, params, keep_master=True, fused=fused)
        with tracer.in_phase("step", 0):
            opt.step(params, grads[0], 1.0 / 1024, **HP)
    live = peak = before = 0
    held = {}
    for kind, sid, nbytes, phase, _it in tracer.events:
        if kind == ALLOC:
            held[sid] = nbytes
            live += nbytes
        elif kind == FREE and sid in held:
            live -= held.pop(sid)
        if phase == "step":
            peak = max(peak, live - before)
        else:
            before = live
    return peak, 4 * max(SIZES)


@pytest.mark.parametrize("fused", [True, False])
def test_fp16_step_holds_one_fp32_gradient_chunk_at_a_time(fused):
    if fused and not fused_available():
        pytest.skip("torch has no fused AdamW kernel")
    peak, one_chunk = _fp32_step_transients(fused)
    whole_shard = 4 * sum(SIZES)
    # one chunk's fp32 gradient copy (+ the single-tensor path's denominator of that chunk),
    # never the whole shard's copies at once
    assert peak >= one_chunk
    assert peak <= 2 * one_chunk + 64 < whole_shard, (peak, one_chunk, whole_shard)

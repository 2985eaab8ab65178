"""ShardAdamW: the chunk-by-chunk update equals torch's AdamW bit for bit, the step's transient
fp32 gradient copies are made one chunk at a time (an up-front conversion of the whole shard
would hold 4Ψ/N_d uncounted bytes at the fp16 step), a device-side multiplier and skip flag give
the float path's values, and on the device each chunk costs three passes: grad x multiplier into
fp32, the fused update, the cast back (no separate copy and multiply)."""
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


@pytest.mark.parametrize("fused", [True, False])
def test_device_multiplier_and_skip_equal_the_host_path(fused):
    """``grad_mult`` as a device scalar gives the float's result bit for bit (bf16 gradients,
    fp32 master); ``found_inf`` = 1 leaves master, moments, training-dtype chunks and the step
    count as they were, 0 updates as if absent."""
    if fused and not fused_available():
        pytest.skip("torch has no fused AdamW kernel")
    params, grads, chunks = _state(torch.bfloat16)
    a_lp, b_lp = [p.clone() for p in params], [p.clone() for p in params]
    a = ShardAdamW(chunks, a_lp, keep_master=True, fused=fused)
    b = ShardAdamW(chunks, b_lp, keep_master=True, fused=fused)
    mult, applied = 0.37 / 1024, 0
    for k, gs in enumerate(grads):
        skip = k == 1
        before = [t.clone() for t in (b.master, b.exp_avg, b.exp_avg_sq, *b_lp)]
        if not skip:
            a.step(a_lp, gs, mult, **HP)
            applied += 1
        b.step(b_lp, gs, torch.tensor(mult, dtype=torch.float64), **HP,
               found_inf=torch.tensor(float(skip)))
        if skip:
            after = (b.master, b.exp_avg, b.exp_avg_sq, *b_lp)
            assert all(torch.equal(x, y) for x, y in zip(before, after))
        assert a.step_count == b.step_count == applied
    assert torch.equal(a.master, b.master) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)
    assert all(torch.equal(x, y) for x, y in zip(a_lp, b_lp))


def test_mixed_dtype_multiply_is_computed_in_fp32():
    """The device path's one pass: a bf16 gradient times a (1,) fp32 multiplier into fp32 is
    the fp32 product of the exact upcast (a 0-dim multiplier would compute in bf16)."""
    g = torch.randn(4096, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    mult = torch.tensor([0.37 / 1024])
    out = torch.empty(4096)
    torch.mul(g, mult, out=out)
    assert torch.equal(out, g.float() * mult)
    assert not torch.equal(out, (g * mult[0]).float())


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_device_step_is_three_passes_per_chunk():
    """On the device (meta tensors, as the dry run; the kernels a GPU runs): per chunk one
    ``mul.out`` (bf16 gradient x multiplier into fp32), one ``_fused_adamw_``, one ``copy_``
    (fp32 master into bf16) -- not a gradient ``_to_copy`` followed by a ``mul_`` (8 more
    bytes per parameter and a launch per chunk)."""
    if not fused_available():
        pytest.skip("torch has no fused AdamW kernel")
    with torch.device("meta"):
        lp = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
        grads = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
        opt = ShardAdamW(_state(torch.float32)[2], lp, keep_master=True, fused=True)
        mult, found_inf = torch.empty((), dtype=torch.float64), torch.empty(())
        ops = _Ops()
        with ops:
            opt.step(lp, grads, mult, found_inf=found_inf, on_chunk=lambda i: None, **HP)
    per_chunk = [n for n in ops.names if n in ("mul.out", "_fused_adamw_.default", "copy_.default",
                                                "_to_copy.default", "mul_.Tensor",
                                                "mul_.Scalar")]
    # the multiplier's copy into the optimizer's scalar, then three per chunk
    assert per_chunk == ["copy_.default"] + ["mul.out", "_fused_adamw_.default",
                                             "copy_.default"] * len(SIZES), per_chunk

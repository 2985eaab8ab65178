"""ZeRO-Offload (``zero.offload_optimizer=cpu``, ``runtime.zero.offload``): with the optimizer
on the host the parameters after N steps equal the same stage without it, worlds 1-3; the
ledger splits host and device bytes as Table 1's offload column says; checkpoints reshard
between offloaded and not; bad settings fail with the fix.

On these CPU ranks host and device are the same memory and torch's fused AdamW runs the same
CPU kernel either way, so the offloaded run is bit-identical to the plain one here (asserted);
the tolerances set for it (fp32 1e-6 on the fp32 master, the training dtype within one of its
ulps) are what a GPU, whose CUDA kernel rounds otherwise, is held to (``TOL``, ``lp_close``).
"""
from __future__ import annotations

import os

import pytest
import torch

from zero_repro import config as C
from zero_repro import validation
from zero_repro.config import ModelConfig, TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.model.gpt import GPT
from zero_repro.runtime.train import checkpoint as ck
from zero_repro.runtime.train.step import train_step
from zero_repro.runtime.zero import build_strategy
from zero_repro.runtime.zero.ledger import is_host
from zero_repro.scale.paper.table1 import offload_bytes

CFG = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=128,
                  vocab_pad_multiple=8)
ROWS, SEED, STEPS, TOL = 6, 5, 4, 1e-6  # 6 rows: every DP size 1-3 trains on the same data
LP = {"fp32": 4, "bf16": 2, "fp16": 2}
# offload modes: (zero.offload_optimizer, zero.offload_param)
MODES = {"none": ("none", "none"), "cpu": ("cpu", "none"), "param": ("none", "cpu"),
         "both": ("cpu", "cpu")}


def make(topo: Topology, stage: int, offload: str, dtype: str = "fp32", bucket: int = 900,
         accum: int = 1, zero_r: dict | None = None, scale_power: int = 8):
    model = GPT(CFG, topo.tp_group)
    model.init_weights(SEED)
    opt, par = MODES[offload]
    zero = ZeroConfig(stage=stage, dtype=dtype, reduce_bucket_size=bucket,
                      allgather_bucket_size=bucket, offload_optimizer=opt, offload_param=par,
                      initial_scale_power=scale_power, hysteresis=1)
    train = TrainConfig(micro_batch_size=ROWS // topo.dp // accum, grad_accum=accum, lr=1e-3,
                        eps=1e-6, weight_decay=0.1)
    zr = None if zero_r is None else ZeroRConfig(**zero_r)
    return build_strategy(model, topo, zero, train, zr)


def train(strategy, topo: Topology, steps, accum: int = 1) -> list:
    """``steps`` steps on a fixed global batch of ``ROWS`` rows (split over DP ranks and
    micro-batches); the StepInfos."""
    mb = ROWS // topo.dp // accum
    infos = []
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randint(0, CFG.vocab_size, (ROWS, CFG.seq_len), generator=g)
        y = torch.randint(0, CFG.vocab_size, (ROWS, CFG.seq_len), generator=g)
        lo = topo.dp_rank * mb * accum
        infos.append(train_step(strategy, [(x[lo + k * mb:lo + (k + 1) * mb],
                                            y[lo + k * mb:lo + (k + 1) * mb])
                                           for k in range(accum)]))
    return infos


def lp_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Training-dtype parameters within one ulp of the dtype at their magnitude."""
    tol = torch.finfo(dtype).eps * torch.maximum(a.abs(), b.abs()).float() + 1e-12
    return bool(((a.float() - b.float()).abs() <= tol).all())


# (stage, dtype, accum, zero_r, scale power): every stage, the three dtypes, gradient
# accumulation (every micro-batch's reduction summed on the host), C_B off
# (stage 2 reduces in one model-size bucket), fp16 starting at a scale that overflows (skipped
# steps: the staged gradients are discarded)
CASES = [(1, "fp32", 1, None, 8), (2, "fp32", 1, None, 8), (3, "fp32", 1, None, 8),
         (2, "bf16", 1, None, 8), (3, "bf16", 2, None, 8), (1, "fp16", 2, None, 8),
         (2, "fp16", 1, None, 30), (2, "fp32", 1, {"constant_buffers": False}, 8)]


def _equivalence_worker(rank: int, world: int, cases: list) -> list:
    out = []
    for stage, dtype, accum, zr, power in cases:
        res = {}
        modes = ("none", "cpu", "param", "both") if stage == 3 else ("none", "cpu")
        for off in modes:
            topo = Topology.build(1)
            s = make(topo, stage, off, dtype, accum=accum, zero_r=zr, scale_power=power)
            infos = train(s, topo, range(STEPS), accum)
            lp = torch.cat([c.detach().clone() for c in s.params.chunks()])  # own chunks
            res[off] = (s.full_parameters(), lp, [i.skipped for i in infos],
                        s.memory_ledger().as_dict())
            s.remove_hooks()
        a, lpa, ska, _ = res["none"]
        if stage < 2 and dtype != "fp32" and accum > 1:
            # offloaded, stages 0-1 reduce each micro-batch and sum on the host as stage 2
            # does (no device gradient store to accumulate into): 16-bit sums round as stage
            # 2's, not as stage 1's local accumulation; stage 2 without offload is the match
            topo = Topology.build(1)
            s = make(topo, 2, "none", dtype, accum=accum, zero_r=zr, scale_power=power)
            infos = train(s, topo, range(STEPS), accum)
            a = s.full_parameters()
            lpa = torch.cat([c.detach().clone() for c in s.params.chunks()])
            ska = [i.skipped for i in infos]
            s.remove_hooks()
        for off in modes[1:]:
            b, lpb, skb, led = res[off]
            diff = max(float((a[k] - b[k]).abs().max()) for k in a)
            out.append({"case": (stage, dtype, accum, zr, power, off), "diff": diff,
                        "equal": all(torch.equal(a[k], b[k]) for k in a)
                        and torch.equal(lpa, lpb),
                        "lp_close": lp_close(lpa, lpb, _dtype(dtype)),
                        "skipped": (ska, skb), "ledger": led})
    return out


def _dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


# (world, dtype) of test_ledger_splits_host_and_device_as_table1s_offload_column
LEDGER_CASES = [(1, "bf16"), (2, "fp16"), (3, "bf16"), (2, "fp32")]


def _world_worker(rank: int, world: int, cases: list, dtypes: list) -> dict:
    """Both tests below at this world size on the same ranks: the equivalence cases
    (``_equivalence_worker``), then the ledger for each of ``dtypes`` (``_ledger_worker``);
    every run builds its own ``Topology`` and strategy, as in a spawn of its own."""
    return {"equivalence": _equivalence_worker(rank, world, cases),
            "ledger": {d: _ledger_worker(rank, world, d) for d in dtypes}}


@pytest.fixture(scope="module")
def by_world():
    """``by_world(world)``: ``_world_worker``'s results per rank, one spawn per world size for
    both tests (three spawns, not seven)."""
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cases = CASES + ([(0, "fp32", 1, None, 8), (0, "bf16", 2, None, 8)]
                             if world == 1 else [])
            # a micro-batch of at least one row (world 4: the 6-row batch has no room to
            # accumulate; offloaded and not are compared on the same rows)
            cases = [c for c in cases if ROWS // world // c[2] >= 1]
            dtypes = [d for w, d in LEDGER_CASES if w == world]
            cache[world] = spawn(_world_worker, world, cases, dtypes, timeout_s=120)
        return cache[world]

    return get


@pytest.mark.parametrize("world", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_offloaded_parameters_equal_the_same_stage_without_offload(by_world, world):
    res = [r["equivalence"] for r in by_world(world)]
    for rank_res in res:
        for r in rank_res:
            stage, dtype = r["case"][:2]
            assert r["diff"] <= TOL, f"{r['case']}: fp32 master differs by {r['diff']}"
            assert r["lp_close"], f"{r['case']}: training-dtype parameters differ"
            # the same CPU kernel on the same values: bit for bit on this machine
            assert r["equal"], f"{r['case']}: not bit-identical (max diff {r['diff']})"
            assert r["skipped"][0] == r["skipped"][1]
    fp16 = [r for r in res[0] if r["case"][4] == 30]
    assert fp16 and any(fp16[0]["skipped"][1]), "the overflowing fp16 case skipped no step"


def _ledger_worker(rank: int, world: int, dtype: str) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        if stage == 0 and world > 1:
            continue
        for mode in ("cpu", "param", "both") if stage == 3 else ("cpu",):
            topo = Topology.build(1)
            s = make(topo, stage, mode, dtype)
            train(s, topo, range(2))
            led = s.memory_ledger()
            out[(stage, mode)] = {"device": led.model_states(), "host": led.host_model_states(),
                                  "psi_padded": sum(g.partition.padded_numel for g in s.groups),
                                  "ledger": led.as_dict()}
            s.remove_hooks()
    return out


@pytest.mark.parametrize("world,dtype", LEDGER_CASES)
def test_ledger_splits_host_and_device_as_table1s_offload_column(by_world, world, dtype):
    res = [r["ledger"][dtype] for r in by_world(world)]
    lp = LP[dtype]
    for r in res:
        for (stage, mode), got in r.items():
            opt, par = MODES[mode]
            # K = 12 also in fp32: offload keeps a master on the host, and with the parameter
            # shard on the host the device's optimizer keeps one
            want = offload_bytes(got["psi_padded"], stage, world, lp_bytes=lp,
                                 optimizer=opt, param=par)
            assert got["device"] == want["device"], (stage, mode, got, want)
            assert got["host"] == want["host"], (stage, mode, got, want)
            led = got["ledger"]
            if opt == "cpu":  # the device keeps the parameters (or nothing), no gradient
                assert led["grads"] == led["master_fp32"] == led["adam_m"] == led["adam_v"] == 0
                assert got["device"] == (0 if par == "cpu" else lp * got["psi_padded"] /
                                         (world if stage == 3 else 1))
            if par == "cpu":
                assert led["params_lp"] == 0 and led["params_lp_host"] > 0
            assert all(is_host(k) for k in ("master_fp32_host", "adam_m_host", "grads_host",
                                            "params_lp_host"))


LAYOUTS = (1, 2, 3)  # sub-worlds of the world-3 spawn (TP 1)
# (source stage, DP, offload) -> (target stage, DP, offload): offloaded resumed in place (bit
# for bit), offloaded -> not and back across stages and DP sizes
CELLS = [((2, 2, "cpu"), (2, 2, "cpu")), ((2, 2, "cpu"), (1, 3, "none")),
         ((1, 3, "none"), (3, 2, "cpu")), ((3, 3, "cpu"), (0, 1, "none")),
         ((0, 1, "cpu"), (2, 3, "cpu"))]
K = 1


def _layouts(rank: int) -> dict:
    out = {}
    for n in LAYOUTS:
        ledger = comm.CommLedger()
        world = comm.new_group("world", range(n), ledger, rank)
        tp_g = None
        for d in range(n):
            tp_g = comm.new_group("tp", [d], ledger, rank) or tp_g
        dp_g = comm.new_group("dp", range(n), ledger, rank)
        if world is not None:
            out[n] = Topology(n, world.rank, 1, n, dp_g.rank, tp_g.rank, world, tp_g, dp_g,
                              ledger)
    return out


def _checkpoint_worker(rank: int, world: int, root: str, cells: list) -> dict:
    topos = _layouts(rank)
    everyone = comm.new_group("all", range(world), comm.CommLedger(), rank)
    refs, out = {}, {}
    for src in sorted({c[0] for c in cells}):
        stage, dp, off = src
        topo = topos.get(dp)
        if topo is not None:
            s = make(topo, stage, off)
            train(s, topo, range(K))
            ck.save(os.path.join(root, "_".join(map(str, src))), s, topo, step=K)
            train(s, topo, range(K, STEPS))
            refs[src] = s.full_parameters()
            s.remove_hooks()
        comm.barrier(everyone)
    for src, dst in cells:
        stage, dp, off = dst
        topo = topos.get(dp)
        if topo is not None:
            s = make(topo, stage, off, bucket=900 if src == dst else 500)
            manifest = ck.load(ck.latest(os.path.join(root, "_".join(map(str, src)))), s, topo)
            train(s, topo, range(manifest["step"], STEPS))
            got = s.full_parameters()
            if rank == 0:
                out[(src, dst)] = max(float((refs[src][k] - got[k]).abs().max())
                                      for k in got)
            s.remove_hooks()
        comm.barrier(everyone)
    return out


def test_checkpoints_reshard_between_offloaded_and_not(tmp_path):
    res = spawn(_checkpoint_worker, 3, str(tmp_path), CELLS, timeout_s=120)[0]
    for src, dst in CELLS:
        diff = res[(src, dst)]
        if src == dst:
            assert diff == 0.0, f"{src} resumed in place differs by {diff}"
        else:
            assert diff <= TOL, f"{src} -> {dst}: max |diff| {diff}"


def test_bad_offload_settings_fail_with_the_fix():
    def cfg(**zero):
        return C.Config(parallel=C.ParallelConfig(world_size=2, tp=1),
                        zero=C.ZeroConfig(**zero))

    with pytest.raises(ValueError, match="one of \\['none', 'cpu'\\]"):
        validation.validate(cfg(stage=2, offload_optimizer="nvme"))
    with pytest.raises(ValueError, match="use zero.stage=1 or 2"):
        validation.validate(cfg(stage=0, offload_optimizer="cpu"))
    bad = cfg(stage=2, offload_optimizer="cpu")
    bad.simulate.stack = "paper2020"
    with pytest.raises(ValueError, match="had no offload"):
        validation.validate(bad)
    validation.validate(cfg(stage=1, offload_optimizer="cpu"))
    one = C.Config(parallel=C.ParallelConfig(world_size=1, tp=1),
                   zero=C.ZeroConfig(stage=0, offload_optimizer="cpu"))
    validation.validate(one)  # stage 0 on one DP rank: the whole optimizer on its one host


def _optimizer_worker(rank: int, world: int) -> str:
    topo = Topology.build(1)
    model = GPT(CFG, topo.tp_group)
    try:
        build_strategy(model, topo, ZeroConfig(stage=2, offload_optimizer="cpu"),
                       TrainConfig(), optimizer=lambda named: torch.optim.SGD(
                           [p for _, p in named], lr=0.1))
    except ValueError as e:
        return str(e)
    return ""


def test_a_torch_optimizer_with_offload_is_refused():
    msg = spawn(_optimizer_worker, 1)[0]
    assert "drop optimizer= or set zero.offload_optimizer=none" in msg


# ------------------------------------------------------------------ HostAdamW on its own
SIZES = (1000, 3000, 500, 2500)  # four chunks of one shard
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_adamw_equals_shard_adamw_block_by_block(dtype):
    """Blocks smaller than the chunks, a gradient multiplier, a missing gradient, chunks
    published in order: the same values as the device optimizer's fused path, bit for bit."""
    from zero_repro.runtime.zero.adam import ShardAdamW
    from zero_repro.runtime.zero.offload import HostAdamW

    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
    chunks, off = [], 0
    for n in SIZES:
        chunks.append((off, n))
        off += n
    keep = dtype != torch.float32
    dev_p, host_p = [p.clone() for p in params], [p.clone() for p in params]
    ref = ShardAdamW(chunks, dev_p, keep_master=keep, fused=True)
    ours = HostAdamW(chunks, host_p, dtype, block=512)  # blocks inside every chunk
    for step in range(3):
        grads = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
        grads[1] = None if step == 1 else grads[1]
        order = []
        ref.step(dev_p, grads, 0.5, **HP)
        ours.step(host_p, grads, 0.5, **HP, on_chunk=order.append)
        assert order == [0, 1, 2, 3]
        for i in range(len(SIZES)):
            assert torch.equal(dev_p[i], host_p[i]), (step, i)
            assert torch.equal(ref.master_chunk(i, dev_p[i]).float(), ours.master_chunk(i))
    assert torch.equal(ref.exp_avg, ours.exp_avg) and torch.equal(ref.exp_avg_sq,
                                                                 ours.exp_avg_sq)
    # PCIe bytes: every gradient but the missing one in, every parameter chunk out
    lp = torch.empty(0, dtype=dtype).element_size()
    assert ours.copied["h2d"] == 3 * sum(SIZES) * lp
    assert ours.copied["d2h"] == (3 * sum(SIZES) - SIZES[1]) * lp


def test_a_discarded_gradient_is_not_used():
    from zero_repro.runtime.zero.offload import HostAdamW

    p = [torch.zeros(8)]
    opt = HostAdamW([(0, 8)], p, torch.float32)
    opt.grad_ready(0, torch.full((8,), 1e6))  # staged for a step that is skipped
    opt.discard()
    opt.step(p, [torch.zeros(8)], 1.0, lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    assert torch.equal(p[0], torch.zeros(8))  # a zero gradient moves nothing


def _traffic_worker(rank: int, world: int) -> dict:
    out = {}
    for stage, accum in ((1, 2), (2, 2), (3, 2), (2, 1)):
        topo = Topology.build(1)
        s = make(topo, stage, "cpu", "bf16", accum=accum)
        train(s, topo, range(STEPS), accum)
        out[(stage, accum)] = (dict(s.opt.copied), s.opt.staging.numel() * 2)
        s.remove_hooks()
    return out


def test_each_micro_batchs_gradient_crosses_once_and_the_parameters_once_per_step():
    """The device keeps no gradient store: every micro-batch's reduced chunk crosses to the
    host (summed there, ZeRO-Offload's ZeRO-2 data flow), the updated parameters come back
    once: lp·Ψ/N_d bytes × micro-batches down, lp·Ψ/N_d up per step."""
    for r in spawn(_traffic_worker, 2, timeout_s=120):
        for (stage, accum), (copied, shard_bytes) in r.items():
            assert copied == {"d2h": STEPS * accum * shard_bytes,
                              "h2d": STEPS * shard_bytes}, (stage, accum)


def test_gpu_proofs_offload_part_on_the_cpu_dry_path():
    """The GPU proof's ZeRO-Offload point (experiments/gpu_proof_offload.py) through the proof's
    own plan and run_point on one gloo rank: every check holds (equal parameters, the ledger
    equals the offload column, lp·Ψ bytes each way per step)."""
    from experiments import gpu_proof as G
    from zero_repro.lab.sweep import point_config
    from tests.integration.test_gpu_proof import _cfg

    cfg = _cfg("experiment.params.device=cpu")
    (pt,) = [p for p in G.plan(cfg) if p.params["part"] == "zero_offload"]
    m = G.run_point(point_config(cfg, pt.overrides), pt)["metrics"]
    assert m["passed"], m["checks"]
    assert set(m["checks"]) == {f"{d}_{k}" for d in ("fp32", "bf16")
                                for k in ("parameters", "ledger", "pcie_bytes")}
    assert m["fp32"]["max_abs_param_diff"] == 0.0  # one host: the same kernel
    assert m["host_step"]["elements_per_s"] > 0


def _where_worker(rank: int, world: int) -> dict:
    out = {}
    for stage in (1, 2, 3):
        topo = Topology.build(1)
        s = make(topo, stage, "cpu", "bf16", bucket=600,
                 zero_r={"constant_buffers": True, "contiguous_memory": True})
        phase, where = ["backward"], []
        store = s.opt.grad_ready

        def record(i, g, store=store, where=where, phase=phase):
            where.append((phase[0], g is not None))
            store(i, g)

        s.opt.grad_ready = record  # the store's calls and the step's
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
        _, loss = s.module(x, x)
        s.backward(loss)
        phase[0] = "step"
        s.step()
        out[stage] = (sum(1 for p, real in where if p == "backward" and real),
                      sum(1 for p, real in where if p == "step" and real), len(s.opt.chunks),
                      s.memory_ledger().get("grads"))
        s.remove_hooks()
    return out


def test_gradient_chunks_leave_for_the_host_during_backward_at_every_stage():
    """Stages 1-3 (ZeRO-Offload's data flow): a chunk's copy starts when its bucket's
    reduction lands in backward, all but the last fused buffers' (depth 2) -- none waits for
    the step -- and the device keeps no gradient store."""
    for stage, (bwd, step, n, grads) in spawn(_where_worker, 2)[0].items():
        assert bwd + step == n, stage
        assert n >= 6 and bwd >= n - 2, (stage, bwd, n)
        assert grads == 0, (stage, grads)


def test_the_rank_programs_memory_line_tells_the_host_apart():
    from zero_repro.lab import rank_log as R

    cfg = C.Config(parallel=C.ParallelConfig(world_size=2, tp=1),
                   zero=C.ZeroConfig(stage=2, dtype="bf16", offload_optimizer="cpu"))
    t1 = R.table1_model_states(cfg)
    assert t1["bytes"] == offload_bytes(t1["psi"], 2, 2)["device"]
    assert t1["formula"] == "2Ψ (offload)"
    parts = R.memory_parts({"params_lp": 100, "grads": 50, "master_fp32": 0,
                            "master_fp32_host": 200, "adam_m_host": 200, "adam_v_host": 200,
                            "grads_host": 50, "optim_step_host": 8, "comm_buffers": 10})
    assert parts == {"states": 150, "buffers": 10, "gathered": 0, "other": 0, "host": 658}
    assert "host memory" in R.memory_text(parts, t1)


def test_preflight_judges_offloads_device_and_host_parts_apart(monkeypatch):
    """The pre-flight's closed form moves the offloaded model states to the host (Table 1's
    offload column) and refuses a point whose ranks' host part does not fit this host, before
    anything starts, even where the GPU has room."""
    import dataclasses
    from types import SimpleNamespace

    from zero_repro.lab import host_memory, preflight
    from zero_repro.runtime.model import flops
    from zero_repro.scale.paper.table1 import model_state_bytes

    cfg = C.Config(parallel=C.ParallelConfig(world_size=2, tp=1),
                   zero=C.ZeroConfig(stage=2, dtype="bf16", offload_optimizer="cpu"))
    plain = preflight.rank_bytes(dataclasses.replace(
        cfg, zero=dataclasses.replace(cfg.zero, offload_optimizer="none")))
    dev, host = preflight.rank_bytes(cfg)
    psi = flops.param_count_per_tp_rank(cfg.model, 1)
    assert plain[1] == 0 and host == pytest.approx(14 * psi / 2)
    assert plain[0] - dev == pytest.approx(model_state_bytes(psi, 2, 2) - 2 * psi)
    gpu = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, device="cuda"))
    monkeypatch.setattr(preflight.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(preflight.torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(host_memory, "available", lambda: (host / 2, "a test's limit"))
    with pytest.raises(ValueError, match="host memory .*bound by a test's limit"):
        preflight.check_resources(gpu)
    monkeypatch.setattr(host_memory, "available", lambda: (1e12, "a test's limit"))
    preflight.check_resources(gpu)  # the same point with room on the host starts


def test_gpu_proofs_parameter_offload_part_on_the_cpu_dry_path():
    """The GPU proof's parameter-offload point (experiments/gpu_proof/offload_param.py) through
    the proof's own plan and run_point on one gloo rank: equal parameters, the device's model
    states 0 and the host's Table 1's offload column with the parameters; the cap and the
    out-of-memory run are CUDA-only checks (not planned here)."""
    from experiments import gpu_proof as G
    from zero_repro.lab.sweep import point_config
    from tests.integration.test_gpu_proof import _cfg

    cfg = _cfg("experiment.params.device=cpu")
    (pt,) = [p for p in G.plan(cfg) if p.params["part"] == "zero_offload_param"]
    m = G.run_point(point_config(cfg, pt.overrides), pt)["metrics"]
    assert m["passed"], m["checks"]
    assert set(m["checks"]) == {"parameters", "ledger"}
    assert m["max_abs_param_diff"] == 0.0 and m["ledger_device"] == 0 < m["ledger_host"]
    assert m["cap_bytes"] is None and m["without_param_oom"] is None

"""Resharding DCP checkpoints (zero_repro.runtime.train.checkpoint): save at ZeRO stage s on DP a, load at
stage t on DP b, continue, and land on the parameters of the run that never stopped.

One spawn at world 4 hosts every layout: sub-worlds of 1, 2 and 4 ranks (ranks 0..n-1) are
built by hand as Topology objects; ranks outside the active sub-world wait at a barrier.
For each source (s, a): train K steps, save, train K more -> reference. For each target
(t, b): fresh model, load, train K steps; rank 0 compares the fp32 parameters (gathered over
DP) with the reference: bit-equal on the diagonal (same stage and DP), <= 1e-6 otherwise
(a different DP size sums gradients in another order). The global batch is fixed (4 rows), so
every DP size trains on the same data. The full 4x4x3x3 matrix is ``@pytest.mark.slow``.
"""
from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from zero_repro.runtime.train import checkpoint as ck
from zero_repro.config import ModelConfig, TrainConfig, ZeroConfig
from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.comm.topology import Topology, grid_rank
from zero_repro.runtime.model.gpt import GPT
from zero_repro.runtime.model.llama import Llama
from zero_repro.runtime.train.step import train_step
from zero_repro.runtime.zero import build_strategy

CFG = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=128,
                  vocab_pad_multiple=8)
# the Llama-shaped model (untied head, grouped-query attention), same vocabulary and sequence
LLAMA = ModelConfig(family="llama", n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                    ffn_hidden=64, seq_len=16, vocab_size=128, vocab_pad_multiple=8, bias=False)
# a tied table (512 x 32) larger than a block (12,704): stage 3 keeps it in row slices
WIDE = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=512,
                   vocab_pad_multiple=8)
MODELS = {"gpt": (GPT, CFG), "llama": (Llama, LLAMA), "gpt_wide": (GPT, WIDE)}
ROWS, SEED, TOL = 4, 11, 1e-6
K, STEPS = 1, 3  # save after K steps (Adam m, v and step count are live), continue to STEPS
LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)]  # (sub-world size, tp)


def build_layouts(rank: int) -> dict:
    """Every rank creates every group of every layout, in one fixed order (torch rule)."""
    out = {}
    for n, tp in LAYOUTS:
        ledger = comm.CommLedger()
        world = comm.new_group("world", range(n), ledger, rank)
        tp_g = dp_g = None
        for d in range(n // tp):
            tp_g = comm.new_group("tp", [grid_rank(d, t, tp) for t in range(tp)], ledger,
                                  rank) or tp_g
        for t in range(tp):
            dp_g = comm.new_group("dp", [grid_rank(d, t, tp) for d in range(n // tp)], ledger,
                                  rank) or dp_g
        if world is not None:
            out[(n, tp)] = Topology(n, world.rank, tp, n // tp, dp_g.rank, tp_g.rank, world,
                                    tp_g, dp_g, ledger)
    return out


def make(topo: Topology, stage: int, bucket: int = 700, kind: str = "gpt"):
    cls, mcfg = MODELS[kind]
    model = cls(mcfg, topo.tp_group)
    model.init_weights(SEED)
    zero = ZeroConfig(stage=stage, reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    train = TrainConfig(micro_batch_size=ROWS // topo.dp, lr=1e-3, eps=1e-6, weight_decay=0.1)
    return build_strategy(model, topo, zero, train)


def train(strategy, topo: Topology, steps) -> None:
    mb = ROWS // topo.dp
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randint(0, CFG.vocab_size, (ROWS, CFG.seq_len), generator=g)
        y = torch.randint(0, CFG.vocab_size, (ROWS, CFG.seq_len), generator=g)
        lo = topo.dp_rank * mb
        train_step(strategy, [(x[lo:lo + mb], y[lo:lo + mb])])


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _matrix_worker(rank, world, root, cells, with_tp, kind="gpt"):
    topos = build_layouts(rank)
    everyone = comm.new_group("all", range(world), comm.CommLedger(), rank)
    refs, out = {}, {}
    for s, a in sorted({(c[0], c[1]) for c in cells}):  # sources: train, save, train on
        topo = topos.get((a, 1))
        if topo is not None:
            strat = make(topo, s, kind=kind)
            train(strat, topo, range(K))
            ck.save(os.path.join(root, f"s{s}a{a}"), strat, topo, step=K)
            train(strat, topo, range(K, STEPS))
            refs[(s, a)] = strat.full_parameters()
            strat.remove_hooks()
        comm.barrier(everyone)
    for s, a, t, b in cells:
        topo = topos.get((b, 1))
        if topo is not None:
            # another bucket grid on purpose, except on the diagonal (bit-equality check)
            strat = make(topo, t, bucket=700 if (s, a) == (t, b) else 300 + 100 * t, kind=kind)
            path = ck.latest(os.path.join(root, f"s{s}a{a}"))
            manifest = ck.load(path, strat, topo)
            train(strat, topo, range(manifest["step"], STEPS))
            got = strat.full_parameters()
            if rank == 0:
                out[(s, a, t, b)] = _max_diff(refs[(s, a)], got)
                out[("sliced", t, b)] = strat.module.wte.row_source is not None
            strat.remove_hooks()
        comm.barrier(everyone)
    if with_tp:
        out.update(_tp_part(rank, topos, everyone, os.path.join(root, "tp"), kind))
    return out


def _run_matrix(tmp_path, cells, with_tp=False, kind="gpt"):
    res = spawn(_matrix_worker, 4, str(tmp_path), cells, with_tp, kind, timeout_s=60)
    for s, a, t, b in cells:
        diff = res[0][(s, a, t, b)]
        if (s, a) == (t, b):
            assert diff == 0.0, f"stage {s} dp {a} resumed in place differs by {diff}"
        else:
            assert diff <= TOL, f"stage {s} dp {a} -> stage {t} dp {b}: max |diff| {diff}"


    return res


# representative subset (4 sources to keep it fast): every stage on the diagonal, every DP size
# as source and target, every stage as source and target of a cross pair, DP grown and shrunk
SUBSET = [(0, 2, 0, 2), (0, 2, 3, 4), (0, 2, 2, 1),
          (1, 4, 1, 4), (1, 4, 0, 1), (1, 4, 3, 2),
          (2, 1, 2, 1), (2, 1, 1, 4),
          (3, 2, 3, 2), (3, 2, 1, 1)]


@pytest.mark.slow
def test_reshard_subset_and_tp(tmp_path):
    """Plus, in the same spawn: a TP=2 checkpoint loads at TP=2 with another stage and DP
    size, and is refused with a clear message at TP=1."""
    res = _run_matrix(tmp_path, SUBSET, with_tp=True)
    for r in (0, 1):  # the two TP ranks of DP rank 0 compare their own TP slices
        assert res[r]["tp_same"] <= TOL, res[r]
        assert "saved with parallel.tp=2" in res[r]["tp_change"], res[r]
        assert "resume with parallel.tp=2" in res[r]["tp_change"]


# Llama: every stage saved and loaded, DP grown and shrunk, plus the TP part
LLAMA_SUBSET = [(0, 2, 3, 4), (1, 4, 2, 1), (2, 1, 0, 2), (3, 2, 3, 2), (3, 2, 1, 4)]


# stage 3 with its vocabulary table in row slices (its own bucket grid) as source and target
WIDE_SUBSET = [(3, 2, 3, 2), (3, 2, 1, 1), (0, 2, 3, 4), (3, 2, 2, 4)]


@pytest.mark.slow
def test_reshard_a_table_read_in_row_slices(tmp_path):
    res = _run_matrix(tmp_path, WIDE_SUBSET, kind="gpt_wide")
    # every stage-3 target really read its table in slices, no other stage did
    assert {k: v for k, v in res[0].items() if k[0] == "sliced"} == {
        ("sliced", t, b): t == 3 for _, _, t, b in WIDE_SUBSET}


@pytest.mark.slow  # a lighter sibling of this test stays in the default suite
def test_reshard_llama(tmp_path):
    res = _run_matrix(tmp_path, LLAMA_SUBSET, with_tp=True, kind="llama")
    for r in (0, 1):
        assert res[r]["tp_same"] <= TOL, res[r]
        assert "saved with parallel.tp=2" in res[r]["tp_change"], res[r]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_reshard_full_matrix(tmp_path, kind):
    stages, dps = range(4), (1, 2, 4)
    _run_matrix(tmp_path, list(itertools.product(stages, dps, stages, dps)), kind=kind)


# ------------------------------------------------------------------ TP: reshard DP, refuse TP
def _tp_part(rank, topos, everyone, root, kind="gpt") -> dict:
    out, ref = {}, None
    topo = topos.get((2, 2))  # tp 2, dp 1 on ranks 0, 1
    if topo is not None:
        strat = make(topo, 1, kind=kind)
        train(strat, topo, range(K))
        ck.save(root, strat, topo, step=K)
        train(strat, topo, range(K, STEPS))
        ref = strat.full_parameters()
        strat.remove_hooks()
    comm.barrier(everyone)
    topo = topos[(4, 2)]  # tp 2, dp 2: same TP degree, ZeRO-3 over a larger DP group
    strat = make(topo, 3, kind=kind)
    m = ck.load(ck.latest(root), strat, topo)
    train(strat, topo, range(m["step"], STEPS))
    got = strat.full_parameters()
    if ref is not None:
        out["tp_same"] = _max_diff(ref, got)
    strat.remove_hooks()
    topo = topos.get((2, 1))  # tp 1: must be refused with a clear message
    if topo is not None:
        try:
            ck.load(ck.latest(root), make(topo, 2, kind=kind), topo)
            out["tp_change"] = "loaded"
        except ck.CheckpointError as e:
            out["tp_change"] = str(e)
    comm.barrier(everyone)
    return out


# --------------------------------------------------- one process: corrupt / mismatched / partial
def _single(stage=0, **model):
    topo = Topology.build(1)
    cfg = ModelConfig(**{**vars(CFG), **model})
    m = GPT(cfg, topo.tp_group)
    m.init_weights(SEED)
    return topo, build_strategy(m, topo, ZeroConfig(stage=stage),
                                TrainConfig(micro_batch_size=ROWS, lr=1e-3, eps=1e-6))


def test_bad_checkpoints_fail_clearly_and_load_nothing(tmp_path):
    topo, strat = _single(stage=1)
    train(strat, topo, range(1))
    path = ck.save(str(tmp_path), strat, topo, step=1, keep=0)
    assert ck.latest(str(tmp_path)) == path
    # same model, other stage: fine, and the step/data position comes back
    t2, s2 = _single(stage=3)
    assert ck.load(path, s2, t2)["step"] == 1
    assert _max_diff(strat.full_parameters(), s2.full_parameters()) == 0.0
    s2.remove_hooks()

    t3, s3 = _single(n_embd=48)  # a different model
    before = s3.full_parameters()
    with pytest.raises(ck.CheckpointError, match="different model.*shape"):
        ck.load(path, s3, t3)
    assert _max_diff(before, s3.full_parameters()) == 0.0  # nothing was loaded
    t4, s4 = _single(n_layer=1)
    with pytest.raises(ck.CheckpointError, match="different model.*not in this model"):
        ck.load(path, s4, t4)

    data = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    with open(os.path.join(path, data), "r+b") as f:  # flip bytes in the middle of the data
        f.seek(os.path.getsize(f.name) // 2)
        f.write(b"\x00\xff\x00\xff")
    t5, s5 = _single(stage=2)
    before = s5.full_parameters()
    with pytest.raises(ck.CheckpointError, match=f"corrupt: file '{data}'"):
        ck.load(path, s5, t5)
    assert _max_diff(before, s5.full_parameters()) == 0.0

    os.remove(os.path.join(path, ck.MANIFEST))  # an interrupted save leaves no manifest
    with pytest.raises(ck.CheckpointError, match="incomplete"):
        ck.load(path, s5, t5)
    assert ck.latest(str(tmp_path)) is None
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.load(str(tmp_path / "nope"), s5, t5)


def test_save_keeps_last_n_and_manifest_describes_state(tmp_path):
    topo, strat = _single(stage=2)
    stale = tmp_path / "step_00000007.partial"  # an earlier run killed in the middle of a save
    stale.mkdir()
    (stale / ".metadata.tmp").write_bytes(b"half")
    assert ck.latest(str(tmp_path)) is None
    for step in (1, 2, 3):
        train(strat, topo, [step])
        ck.save(str(tmp_path), strat, topo, step=step, keep=2)
    dirs = sorted(d for d in os.listdir(tmp_path) if d.startswith("step_"))
    assert dirs == ["step_00000002", "step_00000003"]  # the interrupted save is gone too
    man = json.load(open(tmp_path / "step_00000003" / ck.MANIFEST))
    assert (man["step"], man["stage"], man["dp"], man["tp"], man["opt_step"]) == (3, 2, 1, 1, 3)
    assert man["params"] == {n: list(p.shape) for n, p in strat.module.named_parameters()}


def test_a_damaged_manifest_is_refused_and_passed_over_for_the_intact_one(tmp_path):
    """One bit of the manifest flipped (``"step": 4`` -> 5: '4' is 0x34, '5' 0x35) is refused
    by its own digest, naming the file; the lab's resume passes it over for step 2."""
    from zero_repro.config import Config
    from zero_repro.lab import launcher
    topo, strat = _single(stage=2)
    for step in (2, 4):
        train(strat, topo, [step])
        ck.save(str(tmp_path), strat, topo, step=step, keep=0)
    mpath = tmp_path / "step_00000004" / ck.MANIFEST
    text = mpath.read_text()
    assert text.count('"step": 4,') == 1
    mpath.write_text(text.replace('"step": 4,', '"step": 5,'))
    t2, s2 = _single(stage=2)
    with pytest.raises(ck.CheckpointError, match=f"manifest '{mpath}' is damaged"):
        ck.load(str(tmp_path / "step_00000004"), s2, t2)
    with pytest.raises(ck.CheckpointError, match="is damaged"):  # verify=false checks it too
        ck.read_manifest(str(tmp_path / "step_00000004"), verify=False)
    cfg = Config()
    cfg.checkpoint.dir, cfg.checkpoint.resume = str(tmp_path), "latest"
    cfg.model = CFG
    assert launcher.resolve_resume(cfg, str(tmp_path)) == str(tmp_path / "step_00000002")


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 96 KiB filesystem (tmpfs; needs root), or a skip saying why not."""
    import subprocess
    d = tmp_path / "tiny"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_a_full_disk_is_said_before_the_save_with_bytes_needed_and_free(tiny_disk):
    topo, strat = _single(stage=0)
    train(strat, topo, range(1))
    with pytest.raises(ck.CheckpointError,
                       match=r"not enough disk space .* needs [\d,]+ bytes .* [\d,]+ are free"):
        ck.save(str(tiny_disk / "ck"), strat, topo, step=1)
    assert ck.committed(str(tiny_disk / "ck")) == []


def test_a_truncated_shard_loaded_unverified_names_its_cause(tmp_path):
    topo, strat = _single(stage=1)
    train(strat, topo, range(1))
    path = ck.save(str(tmp_path), strat, topo, step=1)
    data = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    with open(os.path.join(path, data), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    t2, s2 = _single(stage=1)
    with pytest.raises(ck.CheckpointError) as e:
        ck.load(path, s2, t2, verify=False)
    msg = str(e.value)
    assert "rank 0: " in msg and "ranks:dict_keys" not in msg, msg
    assert "verify=false" in msg and f"file '{data}' does not match its SHA-256" in msg, msg

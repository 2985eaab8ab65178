"""The estimator (scale/estimate.py, lab/estimate.py): the trace written at any micro-batch from
one dry run equals the dry run at that micro-batch; the largest micro-batch fits and the next
does not (judged by full dry runs); the per-rank parts add up; Table 1's closed form for the
7B / 8-GPU question; the recommendation rule; DeepSpeed's estimator where installed; bad input."""
from __future__ import annotations

import dataclasses

import pytest

from zero_repro import config as C
from zero_repro import gpus
from zero_repro import schema
from zero_repro import validation
from zero_repro.lab import estimate as L
from zero_repro.scale import estimate as E
from zero_repro.scale.dryrun.dryrun import dry_run
from zero_repro.scale.paper.table1 import model_state_bytes


def base(name: str = "llama_tiny", world: int = 4, tp: int = 1, mem_gb: float = 0.05,
         batch: int = 2) -> C.Config:
    cl = C.ClusterConfig(name="t", device="cuda", backend="nccl", gpus_per_node=2,
                         device_memory_gb=mem_gb, peak_tflops=100, intra_node_gbps=100,
                         inter_node_gbps=100, pcie_gbps=16)
    cfg = C.Config(model=C.ModelConfig(**schema.model_conf(name)),
                   parallel=C.ParallelConfig(world_size=world, tp=tp), cluster=cl)
    cfg.zero = dataclasses.replace(cfg.zero, dtype="bf16")
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=batch)
    return validation.validate(cfg)


@pytest.mark.parametrize("name,world,tp,stage,zr", [
    ("llama_tiny", 4, 1, 0, "ckpt"), ("llama_tiny", 4, 1, 3, "ckpt"),
    ("llama_tiny", 4, 2, 2, "pa"), ("llama_tiny", 4, 2, 1, "pa_cpu"),
    ("tiny", 2, 1, 3, "none"), ("tiny", 3, 1, 1, "ckpt")])
def test_trace_written_at_any_batch_equals_dry_run(name, world, tp, stage, zr):
    cfg = E.stage_config(base(name, world, tp), stage, zr, 1)
    bt, _ = E.prime_trace(cfg)
    for b in (1, 3):
        at_b = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=b))
        assert bt.events(b) == dry_run(at_b, keep_trace=True, details=False).judged_events()


def test_prime_and_pair_agree():
    cfg = E.stage_config(base(), 2, "ckpt", 1)
    runs = {b: dry_run(dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, micro_batch_size=b)), keep_trace=True, details=False) for b in (1, 2, 5)}
    pair = E.BatchTraces.from_pair(runs[1].judged_events(), 1, runs[2].judged_events(), 2)
    prime, _ = E.prime_trace(cfg)
    assert pair.events(5) == prime.events(5) == runs[5].judged_events()


@pytest.mark.parametrize("answer", [0, 1, 2, 7, 100, E.MAX_BATCH])
@pytest.mark.parametrize("seed", [1, 6, 5000])
def test_largest_batch_search(answer, seed):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= answer
    for b0 in (1, 4):
        calls.clear()
        got, n = E.largest_batch(fits, b0, b0 <= answer, seed)
        assert got == answer and n == len(set(calls))
    # near the answer the search takes a handful of judgements
    calls.clear()
    assert E.largest_batch(fits, 1, 1 <= answer, answer)[1] <= 3


def test_estimate_end_to_end_against_dry_runs():
    cfg = base(mem_gb=0.04)
    est = E.estimate(cfg, workers=1, perf_params=E.perf_model.PerfParams())
    assert [s.stage for s in est.stages] == [0, 1, 2, 3]
    for s in est.stages:
        assert s.model_states == model_state_bytes(s.psi_padded, s.stage, s.n_d)
        assert sum(s.parts.values()) == s.live_peak <= s.peak_reserved
        assert s.table1 == pytest.approx(model_state_bytes(s.psi_rank, s.stage, s.n_d),
                                         rel=1e-12)
        # the largest micro-batch: the full dry run there fits, one above does not
        assert s.max_batch >= 1
        for b, want in ((s.max_batch, False), (s.max_batch + 1, True)):
            c = E.stage_config(cfg, s.stage, est.zero_r, b)
            # (the buffers of NCCL's transport, as the estimate of a CUDA cluster)
            assert dry_run(c, keep_trace=False, details=False,
                           transport_of="native").allocator["oom"] is want, (s.stage, b)
        assert s.perf["step_s"] > 0 and 0 < s.perf["mfu"] < 1
        assert s.perf["dp_bytes"] == pytest.approx((3 if s.stage == 3 else 2) * 2
                                                   * E.workload(E.stage_config(
                                                       cfg, s.stage, "ckpt", 2)).params)
    stage, why = est.recommendation
    assert stage in (0, 1, 2, 3) and "smallest stage that fits" in why


def _stage(stage, fits, max_batch, tps):
    return E.StageEstimate(stage=stage, zero_r="ckpt", batch=1, n_d=8, psi_rank=1,
                           psi_padded=1, table1=1.0, model_states=1, parts={}, live_peak=1,
                           peak_reserved=int(40e9), build_live_peak=0, capacity=48e9,
                           fits=fits, max_batch=max_batch,
                           perf_max={"tokens_per_s": tps} if max_batch else {})


def test_recommend_rule():
    stages = [_stage(0, False, 0, 0), _stage(1, True, 3, 100.0), _stage(2, True, 5, 120.0),
              _stage(3, True, 6, 110.0)]
    stage, why = E.recommend(stages)
    assert stage == 2 and "stage 2 fits micro-batch 5 instead of 3" in why
    assert "not faster" in why  # stage 3 buys a batch, not speed
    stages[2] = _stage(2, True, 3, 130.0)  # no larger batch: the smallest stage stays
    stage, why = E.recommend(stages)
    assert stage == 1 and "stage 2 fits no larger micro-batch (3 vs 3)" in why
    assert E.recommend([_stage(s, False, 0, 0) for s in range(4)])[0] is None


def test_table1_for_the_7b_question():
    # Ψ = 7e9, N_d = 8, K = 12: (2+2+12)Ψ = 112 GB; 4Ψ + 12Ψ/8; 2Ψ + 14Ψ/8; 16Ψ/8
    got = E.closed_form(7e9, 8)
    assert [round(got[s] / 1e9, 2) for s in range(4)] == [112.0, 38.5, 26.25, 14.0]


def test_deepspeed_figures_follow_its_formulas():
    pytest.importorskip("deepspeed")
    ds = L.deepspeed_figures(7e9, 8, 8, 131_072_000)
    assert ds[2] == int(2 * 7e9 + 18 * 7e9 / 8)  # 16-bit params + 18 bytes / N_d
    assert ds[3] == 4 * 131_072_000 + int(18 * 7e9 / 8)


def test_largest_layer_of_llama2_7b_is_its_embedding():
    m = C.ModelConfig(**schema.model_conf("llama2_7b"))
    assert L.largest_layer(m, 1) == 32000 * 4096
    assert L.largest_layer(m, 2) == 32000 * 4096 // 2


@pytest.mark.parametrize("argv,msg", [
    (["--gpus", "8", "--device-memory", "48GB"], "give the model"),
    (["--model", "nope", "--gpus", "8", "--device-memory", "48GB"], "no conf/model/nope"),
    (["--model", "llama2_7b", "--gpus", "8"], "give the cluster"),
    (["--model", "llama2_7b", "--gpus", "8", "--gpu", "nope"], "unknown GPU 'nope'"),
    (["--model", "llama2_7b", "--gpus", "8", "--device-memory", "lots"], "48GB"),
    (["--model", "llama2_70b", "--gpus", "64", "--tp", "16", "--cluster", "h100"],
     "does not divide model.n_kv_head=8"),
    (["--model", "llama2_7b", "--gpus", "8", "--cluster", "h100", "--zero-r", "pa"],
     "needs tp > 1"),
    (["--shape", "layers=2,hidden=64,heads=5", "--gpus", "2", "--cluster", "h100"], "n_head"),
])
def test_bad_input_is_one_error_line(argv, msg, capsys):
    assert L.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and msg in err[0], err


def test_a_gpu_kind_alone_is_a_cluster_with_its_facts():
    """``--gpu KEY`` without a cluster: the GPU's datasheet facts (``zero_repro/gpus/KEY.py``)
    fill the custom cluster, links from the flags; a flag given on top is a what-if that stays."""
    gpu = gpus.gpu("h100_sxm")
    argv = ["--model", "llama2_7b", "--gpus", "8", "--gpu", "h100_sxm", "--gpus-per-node", "4",
            "--intra-gbps", "64", "--inter-gbps", "100"]
    c = L.cluster_from_args(L._parser().parse_args(argv))
    assert (c.gpu, c.device_memory_gb, c.device_memory_mib, c.peak_tflops, c.hbm_gbps,
            c.sm_count) == ("h100_sxm", gpu.memory_gb, gpu.memory_mib, gpu.peak_tflops,
                            gpu.hbm_gbps, gpu.sm_count)
    assert (c.gpus_per_node, c.intra_node_gbps, c.inter_node_gbps) == (4, 64, 100)
    c = L.cluster_from_args(L._parser().parse_args(argv + ["--peak-tflops", "500"]))
    assert (c.peak_tflops, c.device_memory_gb) == (500, gpu.memory_gb)


def test_units_and_shape():
    assert L.parse_bytes("48GB") == 48 and L.parse_bytes("80GiB") == pytest.approx(85.899, 1e-4)
    args = L.argparse.Namespace(model=None, seq=None, shape="layers=2,hidden=64,heads=8,"
                                "kv_heads=2,ffn=96,vocab=300,seq=32")
    m = L.model_from_args(args)
    assert (m.family, m.n_kv_head, m.ffn_hidden, m.seq_len, m.bias) == ("llama", 2, 96, 32,
                                                                         False)

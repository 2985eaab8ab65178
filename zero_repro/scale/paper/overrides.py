"""A paper setup (Tables 4-10) as dotted config overrides, stated once: the memory experiments
(Figure 6, Table 2, Figure 7), the dry-run benchmark and the throughput figures' paper-scale
points all build their configs here.

The paper's runs: GPT-2-like models of ``n_layer`` x ``hidden`` with s = 1024 and the GPT-2 BPE
vocabulary (50257, padded by Megatron to a multiple of 128·tp), fp16 with Adam, no dropout in
the memory accounting, one micro-batch per step, Table 3's configuration, and the harness's
constant buffers (``paper.buckets``).
"""
from __future__ import annotations

from zero_repro.scale.paper.buckets import PAPER_BUCKETS
from zero_repro.scale.paper.setups import PaperSetup
from zero_repro.scale.paper.table3 import zero_overrides

SEQ_LEN = 1024
VOCAB = 50257  # GPT-2 BPE
VOCAB_PAD_MULTIPLE = 128


def paper_overrides(n_layer: int, hidden: int, heads: int, gpus: int, tp: int, batch: int,
                    zero_config: str, seq: int = SEQ_LEN, vocab: int = VOCAB,
                    dtype: str | None = "fp16", name: str | None = None,
                    nominal: str = "") -> dict:
    """Dotted overrides for one paper-shaped run: model, parallel layout, ``zero_config``
    (c1..c5 / C1..C5 or ``baseline``: ``paper.table3``), precision and micro-batch.

    ``dtype=None`` leaves ``zero.dtype`` as configured; ``name`` defaults to
    ``gpt_<layers>x<hidden>``; ``nominal`` (the paper's size label) is set when given. These
    three only label or select, but they enter the point key (``lab.records.point_key``),
    so each caller keeps the values its committed records were made with."""
    ov = {"model.name": name or f"gpt_{n_layer}x{hidden}", "model.n_layer": n_layer,
          "model.n_embd": hidden, "model.n_head": heads, "model.seq_len": seq,
          "model.vocab_size": vocab, "model.vocab_pad_multiple": VOCAB_PAD_MULTIPLE,
          "model.dropout": 0.0, "parallel.world_size": gpus, "parallel.tp": tp,
          **zero_overrides(zero_config),
          "train.micro_batch_size": int(batch), "train.grad_accum": 1}
    if dtype is not None:
        ov["zero.dtype"] = dtype
    if nominal:
        ov["model.nominal"] = nominal
    return ov


def setup_overrides(s: PaperSetup, zero_config: str | None = None, batch: int | None = None,
                    buckets: dict | None = None, **kw) -> dict:
    """Overrides for setup ``s``: its shape and layout, ``zero_config`` (default: the one the
    table names), ``batch`` per GPU (default: the table's), the buckets (default: the paper
    harness's); ``kw`` (dtype, name, nominal) as ``paper_overrides``."""
    zc = s.zero_config if zero_config is None else zero_config
    b = s.batch_per_gpu if batch is None else batch
    return {**paper_overrides(s.n_layer, s.hidden, s.heads, s.gpus, s.tp, b, zc, **kw),
            **(PAPER_BUCKETS if buckets is None else buckets)}

"""Token data for training runs: synthetic, a memory-mapped token file, or real text offline.

Every source is defined by its *global* batch for a step (``global_batch(step)`` ->
``[dp * micro_batch, seq + 1]`` int64 tokens), from which each data-parallel rank takes its own
contiguous slice. That makes the data identical inside a TP group (TP ranks share a dp_rank),
different across DP ranks, and lets a single-process reference train on exactly the
concatenation of what the DP ranks saw -- the basis of every equivalence test.

* ``synthetic``: seeded learnable sequences (arithmetic progressions modulo the vocabulary with
  a random start and one of a few strides), so a real model's loss visibly falls below
  ln(vocab) within a few steps instead of sitting at the entropy of uniform noise.
* ``tokens``: a flat ``uint16`` token file (nanoGPT's ``train.bin`` format) read through
  ``numpy.memmap``; windows start at seeded random offsets.
* ``pystdlib``: byte-level tokens (0..255) of this Python installation's own standard-library
  sources: real text that exists on every machine, works offline, and shows real learning.
"""
from __future__ import annotations

import glob
import os
import sysconfig

import numpy as np
import torch

_STRIDES = (1, 2, 3, 5, 7)


class TokenSource:
    """Global batches of ``rows`` sequences of ``seq + 1`` tokens (inputs + shifted targets)."""

    def __init__(self, seq: int, vocab: int, seed: int):
        self.seq, self.vocab, self.seed = seq, vocab, seed

    def global_batch(self, step: int, rows: int) -> torch.Tensor:  # [rows, seq+1]
        raise NotImplementedError


class SyntheticSource(TokenSource):
    def global_batch(self, step: int, rows: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(0, self.vocab, (rows, 1), generator=g)
        stride = torch.tensor(_STRIDES)[torch.randint(0, len(_STRIDES), (rows, 1), generator=g)]
        pos = torch.arange(self.seq + 1).unsqueeze(0)
        return (start + stride * pos) % self.vocab


class MemmapSource(TokenSource):
    def __init__(self, seq: int, vocab: int, seed: int, path: str):
        super().__init__(seq, vocab, seed)
        if not os.path.exists(path):
            raise ValueError(f"train.data_path={path!r} does not exist")
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        if len(self.tokens) <= seq + 1:
            raise ValueError(f"token file {path!r} has {len(self.tokens)} tokens; need > {seq + 1}")

    def global_batch(self, step: int, rows: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq - 1, (rows,), generator=g)
        out = np.stack([self.tokens[s:s + self.seq + 1] for s in starts.tolist()])
        t = torch.from_numpy(out.astype(np.int64))
        if int(t.max()) >= self.vocab:
            raise ValueError(f"token id {int(t.max())} >= model.vocab_size={self.vocab}")
        return t


def stdlib_bytes(max_bytes: int = 8_000_000) -> np.ndarray:
    """Concatenated bytes of the standard library's .py files (sorted, deterministic)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            b = f.read()
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


class StdlibSource(MemmapSource):
    def __init__(self, seq: int, vocab: int, seed: int):  # noqa: D107 - no file: bytes in RAM
        TokenSource.__init__(self, seq, vocab, seed)
        if vocab < 256:
            raise ValueError(f"train.data=pystdlib needs model.vocab_size >= 256 (got {vocab})")
        self.tokens = stdlib_bytes()


def make_source(kind: str, seq: int, vocab: int, seed: int, path: str = "") -> TokenSource:
    if kind == "synthetic":
        return SyntheticSource(seq, vocab, seed)
    if kind == "tokens":
        return MemmapSource(seq, vocab, seed, path)
    if kind == "pystdlib":
        return StdlibSource(seq, vocab, seed)
    raise ValueError(f"train.data={kind!r}: use synthetic, tokens or pystdlib")


def rank_batch(source: TokenSource, step: int, micro_batch: int, dp: int, dp_rank: int,
               micro_index: int = 0, grad_accum: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This DP rank's (inputs, targets) for one micro-batch of optimizer step ``step``.

    The global batch of a step is ``dp * grad_accum * micro_batch`` rows; micro-batch ``k`` of
    DP rank ``d`` is rows ``[(k*dp + d)*mb, (k*dp + d + 1)*mb)``.
    """
    rows = source.global_batch(step, dp * grad_accum * micro_batch)
    lo = (micro_index * dp + dp_rank) * micro_batch
    chunk = rows[lo:lo + micro_batch]
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

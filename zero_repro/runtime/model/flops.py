"""Parameter counts and training FLOPs of the GPT-2-like model (paper §10: the model sizes Ψ and
the TFLOPs/GPU of Figures 2, 3, 4 and 8).

Parameters (bias on, vocabulary V, sequence s, hidden h, layers l):

    Ψ = 12·l·h²  +  13·l·h  +  (V + s)·h  +  2h
        ^ weights  ^ biases    ^ token and   ^ final
          of QKV,    (9h) and    position      LayerNorm
          proj, MLP  LayerNorms  embeddings    (weight, bias)
          (3+1+4+4)  (4h)/block  (LM head tied)

FLOPs per iteration (global batch B of length-s sequences), Megatron-LM's convention
(Narayanan et al., 2021, eq. 3; the ZeRO paper does not state its own): forward =
24·B·s·l·h²·(1 + s/(6h)) + 2·B·s·h·V (matmuls, 2 FLOPs per MAC), backward = 2 × forward, and
with activation recompute the blocks' forward once more (the LM head not):

    with recompute     F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))
    without recompute  F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))

(the logit term 6·B·s·h·V is the same in both). Attention scores count the full s×s product (no causal halving), as Megatron does: the
paper's TFLOPs/GPU convention (``flops_per_iteration``). Utilisation is reported in two honest
forms beside it (PaLM, Chowdhery et al. 2022, App. B):

    MFU's FLOPs (model): no recompute, causal attention (the s² terms halved: the causal mask
        makes half the scores unneeded, and flash/memory-efficient kernels skip them)
        F_model = 72·B·s·l·h²·(1 + s/(12h) + V/(12·l·h))
    HFU's FLOPs (hardware): what runs, recompute included when checkpointing is on
        F_hw = 96·B·s·l·h²·(1 + s/(12h) + V/(16·l·h))     (= F_model without checkpointing)

Entry points: ``param_count``, ``flops_per_iteration``, ``model_flops_per_iteration``,
``tflops_per_gpu``.
"""
from __future__ import annotations

from zero_repro.config import ModelConfig, padded_vocab


def param_count_formula(n_layer: int, hidden: int, vocab: int, seq: int) -> int:
    """12·l·h² + 13·l·h + (V + s)·h + 2h: the model as built with bias=True (see module doc)."""
    l, h = n_layer, hidden
    return 12 * l * h * h + 13 * l * h + (vocab + seq) * h + 2 * h


def _block_params(h: int, bias: bool, tp: int) -> int:
    """One block's parameters on one TP rank (tp=1: the whole block)."""
    matrices = 12 * h * h // tp  # QKV 3h², proj h², fc 4h², proj 4h², split over TP
    if not bias:
        return matrices + 2 * h  # two LayerNorm weights (replicated)
    split_bias = (3 * h + 4 * h) // tp  # column-parallel QKV and fc biases
    replicated = 2 * h + 2 * h + h + h  # LN weights+biases, row-parallel biases
    return matrices + split_bias + replicated


def param_count(cfg: ModelConfig, tp: int = 1, padded: bool = True) -> int:
    """Exact parameter count of ``GPT(cfg)`` summed over all TP ranks.

    ``padded`` uses the embedding as built at TP degree ``tp`` (vocab padded to a multiple of
    vocab_pad_multiple·tp); ``padded=False`` counts the real vocabulary only.
    """
    h = cfg.n_embd
    vocab = padded_vocab(cfg, tp) if padded else cfg.vocab_size
    final_ln = 2 * h if cfg.bias else h
    return cfg.n_layer * _block_params(h, cfg.bias, 1) + (vocab + cfg.seq_len) * h + final_ln


def param_count_per_tp_rank(cfg: ModelConfig, tp: int) -> int:
    """Parameters held by one TP rank of ``GPT(cfg)`` at TP degree ``tp`` (vocab padded)."""
    h = cfg.n_embd
    final_ln = 2 * h if cfg.bias else h
    return (cfg.n_layer * _block_params(h, cfg.bias, tp) + padded_vocab(cfg, tp) // tp * h
            + cfg.seq_len * h + final_ln)


def flops_per_iteration(batch: int, seq: int, n_layer: int, hidden: int, vocab: int,
                        recompute: bool = True) -> float:
    """Training FLOPs of one iteration over ``batch`` sequences (all ranks together).

    recompute=True:  96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))  (Megatron-LM convention)
    recompute=False: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))
    The paper does not state its own formula; see the module docstring for the derivation.
    """
    b, s, l, h, v = batch, seq, n_layer, hidden, vocab
    if recompute:
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def model_flops_per_iteration(batch: int, seq: int, n_layer: int, hidden: int,
                              vocab: int) -> float:
    """MFU's numerator: 72·B·s·l·h²·(1 + s/(12h) + V/(12·l·h)) (no recompute, causal)."""
    b, s, l, h, v = batch, seq, n_layer, hidden, vocab
    return 72.0 * b * s * l * h * h * (1 + s / (12 * h) + v / (12 * l * h))


def hardware_flops_per_iteration(batch: int, seq: int, n_layer: int, hidden: int, vocab: int,
                                 recompute: bool) -> float:
    """HFU's numerator: the model FLOPs plus, with activation checkpointing, the blocks'
    forward once more: 96·B·s·l·h²·(1 + s/(12h) + V/(16·l·h)) (causal)."""
    b, s, l, h, v = batch, seq, n_layer, hidden, vocab
    if not recompute:
        return model_flops_per_iteration(b, s, l, h, v)
    return 96.0 * b * s * l * h * h * (1 + s / (12 * h) + v / (16 * l * h))


def flops_per_iteration_cfg(cfg: ModelConfig, batch: int, recompute: bool = True,
                            tp: int = 1) -> float:
    """``flops_per_iteration`` for a model config, with the vocabulary as built at ``tp``."""
    return flops_per_iteration(batch, cfg.seq_len, cfg.n_layer, cfg.n_embd,
                               padded_vocab(cfg, tp), recompute)


def tflops_per_gpu(flops_per_iter: float, step_time_s: float, n_gpus: int) -> float:
    """Achieved TFLOPs per GPU: FLOPs of one iteration / (time of one iteration · GPUs) / 1e12."""
    if step_time_s <= 0 or n_gpus <= 0:
        raise ValueError(f"step_time_s={step_time_s} and n_gpus={n_gpus} must be positive")
    return flops_per_iter / (step_time_s * n_gpus) / 1e12

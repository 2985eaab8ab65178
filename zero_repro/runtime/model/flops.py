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

Llama (``model.family=llama``, ``runtime.model.llama``): the same count from its shapes
(``flops_per_iteration_shape``): per token and block the forward GEMMs are
2·(2h² + 2h·k + 3h·f) (q, o; k, v of width k = n_kv_head·h/n_head; gate, up, down of width f),
attention 4·s·h (2·s·h causal), the untied LM head 2·h·V; training = 3x forward, + the blocks'
forward once more with recompute. GPT's shapes (k = h, f = 4h, two MLP matrices) give the
formulas above.

Entry points: ``param_count``, ``flops_per_iteration``, ``model_flops_per_iteration``,
``flops_per_iteration_cfg`` (either family; ``causal`` for MFU/HFU), ``tflops_per_gpu``;
``Rates``: a run's three numerators at once, turned into its per-step rates.
"""
from __future__ import annotations

from dataclasses import dataclass

from zero_repro.config import Config, ModelConfig, ffn_width, kv_heads, padded_vocab


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


def _llama_block_matrices(cfg: ModelConfig) -> int:
    """Elements of one Llama block's weight matrices: q, o (h²), k, v (h·k), gate, up, down
    (h·f)."""
    h = cfg.n_embd
    kv = kv_heads(cfg) * (h // cfg.n_head)
    return 2 * h * h + 2 * h * kv + 3 * h * ffn_width(cfg)


def param_count(cfg: ModelConfig, tp: int = 1, padded: bool = True) -> int:
    """Exact parameter count of the model of ``cfg`` (``GPT`` or ``Llama``) summed over all TP
    ranks.

    ``padded`` uses the embedding as built at TP degree ``tp`` (vocab padded to a multiple of
    vocab_pad_multiple·tp); ``padded=False`` counts the real vocabulary only.
    """
    h = cfg.n_embd
    vocab = padded_vocab(cfg, tp) if padded else cfg.vocab_size
    if cfg.family == "llama":  # blocks (2 RMSNorms each), untied embedding and head, final norm
        return cfg.n_layer * (_llama_block_matrices(cfg) + 2 * h) + 2 * vocab * h + h
    final_ln = 2 * h if cfg.bias else h
    return cfg.n_layer * _block_params(h, cfg.bias, 1) + (vocab + cfg.seq_len) * h + final_ln


def param_count_per_tp_rank(cfg: ModelConfig, tp: int) -> int:
    """Parameters held by one TP rank of the model of ``cfg`` at TP degree ``tp`` (vocab
    padded)."""
    h = cfg.n_embd
    if cfg.family == "llama":
        return (cfg.n_layer * (_llama_block_matrices(cfg) // tp + 2 * h)
                + 2 * padded_vocab(cfg, tp) // tp * h + h)
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


def flops_per_iteration_shape(batch: int, seq: int, n_layer: int, hidden: int, vocab: int,
                              recompute: bool = True, kv_width: int | None = None,
                              ffn: int | None = None, gated: bool = False,
                              causal: bool = False) -> float:
    """Training FLOPs of one iteration from the shapes (module docstring): per token and block
    2·(2h² + 2h·k + m·h·f) GEMM FLOPs forward (m = 3 gated, 2 not) + 4·s·h attention, the LM
    head 2·h·V; x3 for forward + backward, blocks x4 with recompute. ``kv_width`` k (default h)
    and ``ffn`` f (default 4h) at GPT's defaults give ``flops_per_iteration``; ``causal`` halves
    the attention term (MFU/HFU's convention)."""
    h = hidden
    k = h if kv_width is None else kv_width
    f = 4 * h if ffn is None else ffn
    block = 2.0 * (2 * h * h + 2 * h * k + (3 if gated else 2) * h * f) + (2.0 if causal else 4.0) * seq * h
    passes = 4 if recompute else 3
    return float(batch) * seq * (passes * n_layer * block + 6.0 * h * vocab)


def flops_per_iteration_cfg(cfg: ModelConfig, batch: int, recompute: bool = True,
                            tp: int = 1, causal: bool = False) -> float:
    """Training FLOPs of one iteration over ``batch`` sequences of the model of ``cfg`` (GPT:
    ``flops_per_iteration``, or with ``causal`` ``hardware_flops_per_iteration`` /
    ``model_flops_per_iteration``; Llama: ``flops_per_iteration_shape``), with the vocabulary as
    built at ``tp``. MFU's numerator: ``recompute=False, causal=True``; HFU's: ``causal=True``."""
    v = padded_vocab(cfg, tp)
    if cfg.family == "llama":
        return flops_per_iteration_shape(
            batch, cfg.seq_len, cfg.n_layer, cfg.n_embd, v, recompute,
            kv_width=kv_heads(cfg) * (cfg.n_embd // cfg.n_head), ffn=ffn_width(cfg), gated=True,
            causal=causal)
    if causal:
        return hardware_flops_per_iteration(batch, cfg.seq_len, cfg.n_layer, cfg.n_embd, v,
                                            recompute)
    return flops_per_iteration(batch, cfg.seq_len, cfg.n_layer, cfg.n_embd, v, recompute)


def tflops_per_gpu(flops_per_iter: float, step_time_s: float, n_gpus: int) -> float:
    """Achieved TFLOPs per GPU: FLOPs of one iteration / (time of one iteration · GPUs) / 1e12."""
    if step_time_s <= 0 or n_gpus <= 0:
        raise ValueError(f"step_time_s={step_time_s} and n_gpus={n_gpus} must be positive")
    return flops_per_iter / (step_time_s * n_gpus) / 1e12


@dataclass(frozen=True)
class Rates:
    """One run's throughput from a step time: tokens per step (B·s, B the global batch of
    micro-batch x accumulation x DP) and the three FLOPs numerators of the module docstring,
    each over the run's ``n_gpus`` (``tflops_per_gpu``): the paper's convention (``flops``,
    recompute counted when checkpointing is on), MFU's (``model_flops``) and HFU's
    (``hardware_flops``)."""

    tokens_per_step: int
    n_gpus: int
    flops: float
    model_flops: float
    hardware_flops: float

    @classmethod
    def of(cls, cfg: Config, dp: int) -> "Rates":
        """The rates of ``cfg``'s run at DP degree ``dp`` on ``dp`` x TP GPUs (its vocabulary as
        built at TP 1)."""
        m, t = cfg.model, cfg.train
        batch = t.micro_batch_size * t.grad_accum * dp
        recompute = cfg.zero_r.activation_checkpointing
        return cls(tokens_per_step=batch * m.seq_len, n_gpus=dp * cfg.parallel.tp,
                   flops=flops_per_iteration_cfg(m, batch, recompute=recompute),
                   model_flops=flops_per_iteration_cfg(m, batch, recompute=False, causal=True),
                   hardware_flops=flops_per_iteration_cfg(m, batch, recompute=recompute,
                                                          causal=True))

    def tflops(self, step_time_s: float) -> float:
        """TFLOPs per GPU in the paper's convention at ``step_time_s``."""
        return tflops_per_gpu(self.flops, step_time_s, self.n_gpus)

    def model_tflops(self, step_time_s: float) -> float:
        """MFU's TFLOPs per GPU (model FLOPs: no recompute, causal) at ``step_time_s``."""
        return tflops_per_gpu(self.model_flops, step_time_s, self.n_gpus)

    def at(self, step_time_s: float, peak_tflops: float = 0.0) -> dict:
        """``tokens_per_s``, ``tflops_per_gpu``, ``model_tflops_per_gpu``,
        ``hardware_tflops_per_gpu`` at ``step_time_s``, and ``mfu`` / ``hfu`` (fractions of
        ``peak_tflops``) when the peak is known (> 0)."""
        out = {"tokens_per_s": self.tokens_per_step / step_time_s,
               "tflops_per_gpu": self.tflops(step_time_s),
               "model_tflops_per_gpu": self.model_tflops(step_time_s),
               "hardware_tflops_per_gpu": tflops_per_gpu(self.hardware_flops, step_time_s,
                                                         self.n_gpus)}
        if peak_tflops > 0:
            out["mfu"] = out["model_tflops_per_gpu"] / peak_tflops
            out["hfu"] = out["hardware_tflops_per_gpu"] / peak_tflops
        return out

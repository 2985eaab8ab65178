"""GPT-2-like and Llama-shaped models with Megatron tensor parallelism, and their parameter/FLOP
counts. ``model_class(cfg)`` is the class ``model.family`` names."""
from zero_repro.runtime.model.flops import (flops_per_iteration, param_count,  # noqa: F401
                                    param_count_per_tp_rank, tflops_per_gpu)
from zero_repro.runtime.model.gpt import GPT, Block, gather_full_state, shard_full_state  # noqa: F401
from zero_repro.runtime.model.llama import Llama  # noqa: F401

FAMILIES = {"gpt": GPT, "llama": Llama}


def model_class(cfg) -> type:
    """The model class of ``cfg.family`` (a ``ModelConfig``): GPT or Llama."""
    return FAMILIES[cfg.family]

"""GPT-2-like model with Megatron tensor parallelism, and its parameter/FLOP counts."""
from zero_repro.runtime.model.flops import (flops_per_iteration, param_count,  # noqa: F401
                                    param_count_per_tp_rank, tflops_per_gpu)
from zero_repro.runtime.model.gpt import GPT, Block, gather_full_state, shard_full_state  # noqa: F401

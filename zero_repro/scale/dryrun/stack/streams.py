"""PyTorch 1.x's stream semantics for the ``paper2020`` dry run (switch
``collective_stream_reuse``): when a block a collective touched can be handed out again, and where
the 2020 harness synchronised the host with the device (paper §10.5, Figure 7's "max cached").

Mechanism (``tracer`` records it, ``allocator`` replays it): PyTorch 1.x's ``ProcessGroupNCCL``
runs every collective on its own NCCL stream and calls ``recordStream`` on the collective's
tensors (inputs, outputs, and the flattened staging tensors of list all-gathers and
reduce-scatters); a block freed by Python while that stream still has work queued goes back to
the pool only once the stream's event completes (``CUDACachingAllocator.cpp`` ``free`` ->
``insert_events``; ``process_events`` at the next ``malloc``). The host runs ahead of the device
between synchronisations (pytorch/pytorch#76861), so in this model a held block is reusable from
the next synchronisation point of the 2020 harness on, or earlier when an allocation would fail
(``free_cached_blocks`` -> ``synchronize_and_free_events``). ``at_free`` (the other end of the
bracket, and the modern stack's semantics) frees every block at its Python free.

Synchronisation points of the 2020 harness (each a ``torch.cuda.synchronize()`` or a blocking
device-to-host read), ``sync(where)``:

  DeepSpeed's timers, ``wall_clock_breakdown: true`` (DSE@405ce794 Megatron-LM/scripts/
  ds_zero_stage_2_config.json L28), each start/stop synchronises (DS@f2ac7eafd
  deepspeed/pt/deepspeed_timer.py L33, L40): forward start/stop (deepspeed_light.py L674-684),
  backward start, backward_inner stop, backward_allreduce stop (L729-766), step start/stop
  (L784-833); the ZeRO stage-2 step's own timers optimizer_step / optimizer_allgather
  (deepspeed_zero_optimizer.py L1094, L1103, L1105, L1145) and its ``.item()`` reads (overflow
  L1219, gradient norm L953, L964); stage 1's overflow and norm ``.item()`` (deepspeed_utils.py
  L79, L159, L170).
  Megatron's checkpointed layers, ``--synchronize-each-layer`` (column 15 = true in every
  DSE@405ce794 scripts/hyperscale/*.dat; ds_gpt_experiment_loop.sh L121-124): a synchronize at
  the start and end of every layer's forward and backward (mpu/random.py L308, L432, L443,
  L507).

Outside a ``CategoryTracer`` with ``streams=True`` both functions do nothing.
"""
from __future__ import annotations

import torch

from zero_repro.scale.dryrun.stack import categories as K

AT_FREE, AFTER_SYNC = "at_free", "after_sync"
MODES = (AT_FREE, AFTER_SYNC)


def sync(where: str = "") -> None:
    """A synchronisation point of the 2020 harness (``where`` names it, module docstring)."""
    if K._ACTIVE:
        K._ACTIVE[-1].sync()


def record(t: torch.Tensor) -> None:
    """``recordStream(t, nccl_stream)`` that PyTorch 1.x made beyond a collective's own
    arguments (the copy of a list all-gather's flattened output back into the list)."""
    if K._ACTIVE:
        K._ACTIVE[-1].record_use(t)

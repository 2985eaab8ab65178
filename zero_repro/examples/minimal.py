"""Minimal direct use of the ZeRO-DP runtime (paper §5: P_os, P_os+g, P_os+g+p) on a TP x DP grid.

    torchrun --nproc_per_node 2 -m zero_repro.examples.minimal            # DP 2, stage 2, CPU/gloo
    torchrun --nproc_per_node 4 -m zero_repro.examples.minimal --tp 2     # TP 2 x DP 2
    torchrun --nproc_per_node 8 -m zero_repro.examples.minimal --device cuda --dtype bf16

What a program has to do, in order: (1) initialise the process group from the launcher's
environment (RANK / WORLD_SIZE / MASTER_ADDR, set by torchrun or srun); (2) build the TP x DP
grid (``Topology``: TP ranks contiguous); (3) build the model with its TP group, then wrap it:
TP -> activation checkpointing -> ZeRO strategy -> optimizer (``train.trainer.Trainer`` does this
from one ``Config``, the model made unit by unit on the device); (4) feed each DP rank its own slice of the global batch — inputs and
targets are int64 token ids of shape ``(micro_batch, seq_len)``, the same on the TP ranks of one
DP rank; (5) forward, ``strategy.backward(loss)``, ``strategy.step()`` (ZeRO's reduce-scatter /
all-gather and the sharded AdamW), ``strategy.zero_grad()``; (6) save sharded checkpoints with
``trainer.save`` (``zero_repro.runtime.train.checkpoint.save``) into a directory of your choice (``--ckpt-dir``;
default: a new private one per run; every rank writes its shard; ``checkpoint.load`` restores
them at any stage or DP size).

ZeRO partitions over the DP ranks: with DP = 1 (e.g. 2 ranks as TP 2) every stage is stage 0 in
all but name, so run at least 2 DP ranks to see the memory ledger shrink with the stage.
"""
from __future__ import annotations

import argparse
import logging
import tempfile

from zero_repro.config import Config, ModelConfig, ParallelConfig, TrainConfig, ZeroConfig
from zero_repro.runtime.comm import comm, launch
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.train.trainer import Trainer
from zero_repro.runtime.train.build import device_for
from zero_repro.runtime.train.data import make_source, rank_batch
from zero_repro.runtime.zero.ledger import MODEL_STATE_CATEGORIES

log = logging.getLogger("zero_repro.examples.minimal")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="Train a tiny GPT with ZeRO for a few steps.")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--ckpt-dir", default="",
                    help="where the checkpoint goes (default: a new private directory in the "
                         "temporary directory, named in the last log line)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    # (1) process group from torchrun's / srun's environment (gloo on CPU, nccl on GPUs)
    rank, world, local_rank = launch.init_from_env("nccl" if args.device == "cuda" else "gloo")
    cfg = Config(model=ModelConfig(name="tiny", n_layer=2, n_embd=64, n_head=4, seq_len=64,
                                   vocab_size=512),
                 parallel=ParallelConfig(world_size=world, tp=args.tp),
                 zero=ZeroConfig(stage=args.stage, dtype=args.dtype),
                 train=TrainConfig(lr=3e-3, micro_batch_size=2, steps=args.steps))
    cfg.cluster.device = args.device
    try:
        # (2) the grid; (3) TP model -> activation checkpointing -> ZeRO wrap -> optimizer, the
        # model made unit by unit on the device (runtime.train.trainer; .fit(source) would run
        # the whole loop: the steps are written out here to show them)
        topo = Topology.build(tp=args.tp)
        device = device_for(cfg, local_rank)
        trainer = Trainer(cfg, topo, device)
        strategy = trainer.strategy
        source = make_source("synthetic", cfg.model.seq_len, cfg.model.vocab_size, seed=1)
        for step in range(args.steps):
            # (4) this DP rank's rows of the global batch: x, y of shape (2, 64), int64
            x, y = rank_batch(source, step, cfg.train.micro_batch_size, topo.dp, topo.dp_rank)
            x, y = x.to(device), y.to(device)
            # (5) one step
            loss = strategy.module(x, y)[1]  # the logits are not kept through backward
            strategy.backward(loss)
            info = strategy.step()
            strategy.zero_grad()
            if rank == 0:
                log.info("step %d  loss %.4f  grad_norm %.3g", step, float(loss.detach()),
                         float(info.grad_norm))
        # (6) a sharded checkpoint of this step (collective: every rank writes its shard) into
        # a directory of this run's own: rank 0 makes a fresh one (0700) and tells the others
        ckpt_dir = args.ckpt_dir or comm.all_gather_object(
            tempfile.mkdtemp(prefix="zr_minimal_ckpt_") if rank == 0 else "", topo.world)[0]
        path = trainer.save(ckpt_dir, args.steps)
        ledger = strategy.memory_ledger().as_dict()  # bytes per category, this rank
        if rank == 0:
            # Table 1's model states (params, grads, fp32 master, Adam moments) apart from the
            # buffers and gathered parameters, which are no model state
            states = strategy.memory_ledger().model_states()
            rest = {k: v for k, v in ledger.items() if k not in MODEL_STATE_CATEGORIES and v}
            log.info("world %d = TP %d x DP %d, stage %d: model states %d bytes on rank 0 "
                     "(%s); besides them %s; checkpoint %s", world, topo.tp, topo.dp,
                     args.stage, states, ", ".join(f"{c} {ledger.get(c, 0)}"
                                                   for c in MODEL_STATE_CATEGORIES),
                     rest or "nothing", path)
            log.info("communication (elements per collective and group): %s",
                     topo.ledger.as_dict())
        trainer.close()
        return {"loss": float(loss.detach()), "ledger": ledger, "checkpoint": path}
    finally:
        launch.teardown()


if __name__ == "__main__":
    main()

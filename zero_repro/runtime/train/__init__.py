"""Training: build (TP -> activation checkpointing -> ZeRO -> optimizer), one step, the loop,
data, distributed checkpoints."""

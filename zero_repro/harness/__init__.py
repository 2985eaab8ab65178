"""Experiment harness (layer above measure/simulate, below experiments/): points, the experiment
registry, sweeps, records, regeneration of tables and figures, comparison with the paper."""

"""Running experiments and keeping their results: the CLI, the launcher (CLI process) and the rank
program (every rank), sweeps, records, provenance, pre-flight, Slurm, W&B, figures, peers, bench."""

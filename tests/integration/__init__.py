"""End-to-end tests: the command line, experiments and their committed results, Slurm,
faults, shared nodes, peers."""

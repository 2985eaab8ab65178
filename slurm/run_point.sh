#!/bin/bash
# Run ONE planned point inside a Slurm allocation and record it.
#
#   bash slurm/run_point.sh POINT_FILE
#
# POINT_FILE comes from `python run.py +exp=NAME cluster=... launcher=slurm experiment.action=plan`
# (it holds the experiment module, the point and its resolved config). This script runs the point
# runner once, on the first node of the allocation; for measured points run_training starts one
# rank per GPU with `srun` (SLURM-env init, NCCL), and the record is appended atomically to
# results/<exp>/points.jsonl (a point already recorded is replaced, never duplicated).
set -euo pipefail
POINT_FILE=${1:?usage: run_point.sh POINT_FILE}
POINT_FILE=$(realpath "$POINT_FILE")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm/env.sh
source "$here/env.sh"
cd "$here/.."
exec "${PYTHON:-python}" -m zero_repro.lab.sweep --point-file "$POINT_FILE"

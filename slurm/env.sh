# Environment for every zero-repro Slurm job (sourced by run_point.sh and by the submitit jobs
# that `launcher=slurm` submits). Site-specific settings go in slurm/site.sh (not committed).
#
# Rendezvous: ranks are started by `srun` (one task per GPU) and initialise from the Slurm
# environment (zero_repro.runtime.comm.launch.init_from_env reads SLURM_PROCID / SLURM_NTASKS /
# SLURM_LOCALID). MASTER_ADDR (the allocation's first node) is exported below. MASTER_PORT is
# not: each srun step's rank 0 binds a port the kernel chooses and hands it to its peers
# through the run directory, so two jobs on a node, or two sweeps in one allocation, never
# share one (a port you export yourself is used as given; `srun --resv-ports` ports are used
# where the site configures them). The torchrun recipe (slurm/README.md) needs one port known
# to every node before it starts: `zr_free_port` prints one free on this node now.
if [ -n "${SLURM_JOB_NODELIST:-}" ] && command -v scontrol >/dev/null 2>&1; then
  MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
  export MASTER_ADDR
fi
zr_free_port() {
  "${PYTHON:-python}" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

# NCCL: fail fast instead of hanging when a rank dies; warnings only in the logs
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}  # name used by torch < 2.2
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}          # use InfiniBand between nodes
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}  # GPUDirect RDMA when NIC and GPU share a PCIe switch
# Usually site specific (set them in slurm/site.sh): NCCL_SOCKET_IFNAME (e.g. ib0 or eno1),
# NCCL_IB_HCA (DGX-2: mlx5_0..mlx5_7 compute NICs; DGX A100: mlx5_0..3,mlx5_6..9).

# one rank per GPU; leave the CPU cores to the data loader and NCCL proxy threads
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONUNBUFFERED=1

_zr_slurm_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -f "$_zr_slurm_dir/site.sh" ]; then
  # shellcheck source=/dev/null
  source "$_zr_slurm_dir/site.sh"
fi

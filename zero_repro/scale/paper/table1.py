"""Table 1 (paper §5): per-device bytes of the model states under each ZeRO-DP stage.

Mixed-precision Adam keeps lp-byte parameters and gradients (lp = 2 for fp16) and K = 12 bytes
per parameter of fp32 master weights, momentum and variance. With Ψ parameters (of this TP
shard) and N_d data-parallel ranks:

    baseline  (2·lp + K)·Ψ                 = 16Ψ
    P_os      2·lp·Ψ + K·Ψ/N_d             = 4Ψ + KΨ/N_d
    P_os+g    lp·Ψ + (lp + K)·Ψ/N_d        = 2Ψ + 14Ψ/N_d
    P_os+g+p  (2·lp + K)·Ψ/N_d             = 16Ψ/N_d

Hierarchical sharding (``zero.shard_size`` = G, FSDP2's HSDP, MiCS): stages 1-3 partition over the
G ranks of a shard group and keep N_d/G replicas, so every N_d above reads G (P_os: 4Ψ + KΨ/G,
P_os+g: 2Ψ + 14Ψ/G, P_os+g+p: 16Ψ/G): a rank holds what plain ZeRO over G ranks holds. The
replicas sum each owned gradient chunk once per step: an all-reduce of Ψ/G elements, 2Ψ/G in
§7's count, over the replicate group (``replicate_volume``), besides the shard group's 2Ψ
(stages 1-2) or 3Ψ (stage 3).

ZeRO++'s hpZ (Wang et al. 2023, arXiv:2306.10209 §3.2; ``hpz_size`` = the ranks of the
secondary group, a node's DP ranks; DeepSpeed's ``zero_hpz_partition_size``, DeepSpeed@edaa7221
deepspeed/runtime/zero/config.py L309, the secondary shard of tensor_size // hpz ranks at
partition_parameters.py L1884), stage 3 only: optimizer states, gradients and the primary
parameter shard stay partitioned over all N_d ranks and each rank adds a secondary lp shard over
its hpz_size ranks, 16Ψ/N_d + 2Ψ/hpz_size, so that the backward's all-gather stays inside the
node (the communication: ``scale.hsdp``).

With ZeRO-Offload (Ren et al. 2021 §4.1; ``zero.offload_optimizer=cpu``, ``runtime.zero.offload``)
the K bytes move to the host with the gradient shard (lp bytes: the buffer the reduced gradients
arrive in and the updated parameters leave from); the device keeps only the stage's lp
parameters (``offload_bytes``; stage 0 only at N_d = 1); with ZeRO-3 Offload
(``zero.offload_param=cpu``, stage 3) the lp parameter shard moves to the host too and the
device keeps no model state between uses (its working set: gathered units, fused buffers):

              device                  host
    baseline  lp·Ψ     = 2Ψ           (K + lp)·Ψ     = 14Ψ  (N_d = 1)
    P_os      lp·Ψ     = 2Ψ           (K + lp)·Ψ/N_d = 14Ψ/N_d
    P_os+g    lp·Ψ     = 2Ψ           (K + lp)·Ψ/N_d = 14Ψ/N_d
    P_os+g+p  lp·Ψ/N_d = 2Ψ/N_d       (K + lp)·Ψ/N_d = 14Ψ/N_d
      + param 0                       (K + 2·lp)·Ψ/N_d = 16Ψ/N_d
      param alone (optimizer on the device): device (K + lp)·Ψ/N_d, host lp·Ψ/N_d

The one statement of these formulas: the memory model, the dry run's checks, Table 1's experiment
and the runtime's ledger tests all call ``model_state_bytes`` (and ``offload_bytes``). ``STAGE_NOTATION`` is the one home
of the stages' names in the paper's notation; Table 1's column labels (``STAGE_NAMES``) derive
from it.
"""
from __future__ import annotations

K_ADAM = 12  # bytes of optimizer state per parameter (fp32 master + Adam m + v)
# the ZeRO-DP stages in the paper's notation (§5): the one home of the stage names
STAGE_NOTATION = {0: "baseline DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
# Table 1's column labels, the keys of its rows in results/paper/reference.csv: the notation as
# the table prints it ("Pos", "Pos+g", "Pos+g+p"; stage 0 "baseline")
STAGE_NAMES = {k: "baseline" if k == 0 else v.replace("_", "") for k, v in STAGE_NOTATION.items()}
TABLE1_PSI = {"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12}  # the table's model sizes
TABLE1_ND = (1, 4, 16, 64, 256, 1024)  # the table's DP degrees


def model_state_bytes(psi: float, stage: int, n_d: int, K: int = K_ADAM, lp_bytes: int = 2,
                      shard_size: int | None = None, hpz_size: int | None = None) -> float:
    """Per-rank bytes of lp params + lp grads + K bytes/param optimizer state (Table 1);
    ``shard_size`` G (default N_d): the states partitioned over G ranks; ``hpz_size``: stage 3
    with hpZ's secondary lp shard over that many ranks (module docstring)."""
    if hpz_size is not None:
        if stage != 3 or shard_size not in (None, n_d):
            raise ValueError(f"hpZ at stage {stage}, shard_size={shard_size}: hpZ is stage 3's "
                             f"with the primary partition over all N_d={n_d} ranks")
        if hpz_size < 1 or n_d % hpz_size:
            raise ValueError(f"hpz_size={hpz_size} must divide n_d={n_d}")
        return model_state_bytes(psi, 3, n_d, K, lp_bytes) + lp_bytes * psi / hpz_size
    if shard_size is not None:
        if shard_size < 1 or n_d % shard_size:
            raise ValueError(f"shard_size={shard_size} must divide n_d={n_d}")
        n_d = shard_size
    if stage == 0:
        return (2 * lp_bytes + K) * psi
    if stage == 1:
        return 2 * lp_bytes * psi + K * psi / n_d
    if stage == 2:
        return lp_bytes * psi + (lp_bytes + K) * psi / n_d
    if stage == 3:
        return (2 * lp_bytes + K) * psi / n_d
    raise ValueError(f"stage={stage} must be 0, 1, 2 or 3")


def replicate_volume(psi: float, stage: int, n_d: int, shard_size: int | None = None) -> float:
    """§7 elements per rank and step over the replicate group of hierarchical sharding: the
    all-reduce of the owned gradient shard, 2Ψ/G (0 with one replica, and at stage 0, whose
    all-reduce over DP is the baseline's 2Ψ)."""
    g = n_d if shard_size is None else shard_size
    if stage == 0 or g == n_d:
        return 0.0
    return 2 * psi / g


def offload_bytes(psi: float, stage: int, n_d: int, K: int = K_ADAM, lp_bytes: int = 2,
                  optimizer: str = "cpu", param: str = "none") -> dict[str, float]:
    """Per-rank model-state bytes with ZeRO-Offload (module docstring): {"device", "host"}.
    ``optimizer``: ``zero.offload_optimizer`` (the K bytes and the gradient shard on the host;
    stage 0 keeps the whole optimizer on the host of each rank, N_d = 1 only); ``param``:
    ``zero.offload_param`` (stage 3's lp parameter shard on the host)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage} must be 0, 1, 2 or 3")
    if param == "cpu" and stage != 3:
        raise ValueError(f"offload_param=cpu at stage {stage}: stage 3 only")
    shard = psi if stage == 0 else psi / n_d
    params = lp_bytes * (psi / n_d if stage == 3 else psi)
    if optimizer == "cpu":
        device, host = params, (K + lp_bytes) * shard
    else:
        device, host = model_state_bytes(psi, stage, n_d, K, lp_bytes), 0.0
    if param == "cpu":
        device, host = device - params, host + params
    return {"device": device, "host": host}

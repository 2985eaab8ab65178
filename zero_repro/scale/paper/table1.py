"""Table 1 (paper §5): per-device bytes of the model states under each ZeRO-DP stage.

Mixed-precision Adam keeps lp-byte parameters and gradients (lp = 2 for fp16) and K = 12 bytes
per parameter of fp32 master weights, momentum and variance. With Ψ parameters (of this TP
shard) and N_d data-parallel ranks:

    baseline  (2·lp + K)·Ψ                 = 16Ψ
    P_os      2·lp·Ψ + K·Ψ/N_d             = 4Ψ + KΨ/N_d
    P_os+g    lp·Ψ + (lp + K)·Ψ/N_d        = 2Ψ + 14Ψ/N_d
    P_os+g+p  (2·lp + K)·Ψ/N_d             = 16Ψ/N_d

With ZeRO-Offload (Ren et al. 2021; ``zero.offload_optimizer=cpu``, ``runtime.zero.offload``)
the K bytes move to the host with a copy of the gradient shard (lp bytes: the buffer the
gradients arrive in and the updated parameters leave from); the device keeps the stage's
parameters and gradients (``offload_bytes``; stage 0 only at N_d = 1):

              device                           host
    baseline  2·lp·Ψ            = 4Ψ           (K + lp)·Ψ     = 14Ψ  (N_d = 1)
    P_os      2·lp·Ψ            = 4Ψ           (K + lp)·Ψ/N_d = 14Ψ/N_d
    P_os+g    lp·Ψ + lp·Ψ/N_d   = 2Ψ + 2Ψ/N_d  (K + lp)·Ψ/N_d = 14Ψ/N_d
    P_os+g+p  2·lp·Ψ/N_d        = 4Ψ/N_d       (K + lp)·Ψ/N_d = 14Ψ/N_d

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


def model_state_bytes(psi: float, stage: int, n_d: int, K: int = K_ADAM, lp_bytes: int = 2
                      ) -> float:
    """Per-rank bytes of lp params + lp grads + K bytes/param optimizer state (Table 1)."""
    if stage == 0:
        return (2 * lp_bytes + K) * psi
    if stage == 1:
        return 2 * lp_bytes * psi + K * psi / n_d
    if stage == 2:
        return lp_bytes * psi + (lp_bytes + K) * psi / n_d
    if stage == 3:
        return (2 * lp_bytes + K) * psi / n_d
    raise ValueError(f"stage={stage} must be 0, 1, 2 or 3")


def offload_bytes(psi: float, stage: int, n_d: int, K: int = K_ADAM, lp_bytes: int = 2
                  ) -> dict[str, float]:
    """Per-rank model-state bytes with the optimizer offloaded (module docstring):
    {"device": the stage's lp parameters + lp gradients, "host": K + lp bytes per shard
    element}. Stage 0 keeps the whole optimizer on the host of each rank (N_d = 1 only)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage} must be 0, 1, 2 or 3")
    device = model_state_bytes(psi, stage, n_d, 0, lp_bytes)
    shard = psi if stage == 0 else psi / n_d
    return {"device": device, "host": (K + lp_bytes) * shard}

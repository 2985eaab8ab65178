"""The largest model one GPU trains, per offload mode (ZeRO-Offload, Ren et al. 2021 §4.1 and
§6.2; ZeRO-3 Offload / ZeRO-Infinity's CPU tier): the depth search of
``experiments.one_card_max``.

A model of the family is fixed but for its depth l (GPT-2 shaped: hidden h, heads, sequence
and vocabulary from the experiment's overlay). Each judgement is the estimate's own
(``scale.estimate.estimate`` with one stage, no micro-batch search): the dry run and its
caching-allocator replay at the device's capacity (device verdict) and the dry run's host
ledger against the host a rank has (host verdict). Both needs are affine in l -- the model
states are affine in Ψ(l) = Ψ_0 + l·Ψ_block and the activations of a checkpointed model add one
block input per layer --

    need_dev(l) = D_a + (l - a)·(D_b - D_a)/(b - a)      need_host(l) likewise from H_a, H_b

so two judged depths a < b give the depth where each need meets its capacity,
l* = min(l_dev, l_host) (the smaller names the binding memory). Where l* is at most
``confirm_max`` the answer is then judged: l* and l* + 1 are dry-run (and the depth moved one
layer at a time until l* fits and l* + 1 does not); above it (hundreds of layers, minutes of
dry run each) the answer is the extrapolation, and says so (``method``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

Judge = Callable[[int], dict]  # depth -> {"fits", "device_fits", "host_fits", "peak_reserved",
#                                         "capacity", "host_bytes", "host_capacity", ...}


def crossing(a: dict, b: dict, need: str, cap: str) -> float:
    """The depth where the affine need through judged depths ``a`` and ``b`` meets the
    capacity (inf when it does not grow with depth or the capacity is unknown)."""
    if not b[cap]:
        return math.inf
    slope = (b[need] - a[need]) / (b["depth"] - a["depth"])
    if slope <= 0:
        return math.inf
    return a["depth"] + (b[cap] - a[need]) / slope


@dataclasses.dataclass
class Answer:
    depth: int  # the largest depth judged (or extrapolated) to fit; 0: none fits
    binds: str  # "device" or "host": the memory that stops the next depth
    method: str  # "judged" or "extrapolated"
    judged: dict  # depth -> judgement, every dry run made


def largest_depth(judge: Judge, probes: tuple[int, int] = (2, 6), confirm_max: int = 96,
                  max_depth: int = 4096) -> Answer:
    """The largest depth that fits (module docstring)."""
    seen: dict[int, dict] = {}

    def j(d: int) -> dict:
        if d not in seen:
            seen[d] = {**judge(d), "depth": d}
        return seen[d]

    a, b = (j(d) for d in probes)
    l_dev = crossing(a, b, "peak_reserved", "capacity")
    l_host = crossing(a, b, "host_bytes", "host_capacity")
    binds = "device" if l_dev <= l_host else "host"
    est = min(max_depth, int(math.floor(min(l_dev, l_host))))
    if est > confirm_max:
        return Answer(est, binds, "extrapolated", seen)
    d = max(1, est)
    while d > 1 and not j(d)["fits"]:
        d -= 1
    if not j(d)["fits"]:
        return Answer(0, _binding(j(d)), "judged", seen)
    while d < max_depth and j(d + 1)["fits"]:
        d += 1
    return Answer(d, _binding(j(d + 1)), "judged", seen)


def _binding(verdict: dict) -> str:
    return "host" if verdict["device_fits"] and not verdict["host_fits"] else "device"

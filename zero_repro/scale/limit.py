"""At the limit: a memory verdict with a band (``scale.estimate``'s verdict row). The judged
verdict replays the dry run's trace through the caching-allocator model at one capacity (the
device less the middle of the bytes outside the allocator); a real run differs from that
point by what the model leaves open, so a need within that band of the device is neither a
safe "fits" nor a sure "OOM":

    need_low  = live peak + outside_low
    need_high = peak reserved + (peak reserved - live peak) + outside_high
    verdict   = fits          if need_high <= device
                OOM           if need_low > device (or the judged replay ran out while building)
                at the limit  otherwise (the judged verdict said beside it)

* fragmentation: the replay's own allocator extra (peak reserved less the live peak: block
  rounding, cached and split blocks) taken as its uncertainty either way -- a run may pack
  as tightly as the live bytes (PyTorch's ``expandable_segments``; the caching allocator
  frees its cached blocks and retries a failed cudaMalloc before it reports OOM,
  c10/cuda/CUDACachingAllocator.cpp ``release_cached_blocks``), or fragment as much again;
* outside the allocator: the stack's bracket (CUDA context, NCCL buffers; modern
  ``scale.outside_modern``, 2020 ``dryrun.stack.outside``), its low and high ends.
"""
from __future__ import annotations

from zero_repro.scale.dryrun.stack import switches as S

VERDICTS = ("fits", "at the limit", "OOM")


def judge(live_peak: float, peak_reserved: float, device: float, outside_low: float,
          outside_high: float, judged_fits: bool, build_fits: bool = True) -> dict:
    """The verdict with its band (module doc): ``verdict``, ``need_low``, ``need_high`` (bytes
    on the device), ``margin`` (device less the judged need, fraction of the device)."""
    extra = max(0.0, peak_reserved - live_peak)
    lo = live_peak + outside_low
    hi = peak_reserved + extra + outside_high
    if not build_fits or lo > device:
        word = "OOM"
    elif hi <= device and judged_fits:
        word = "fits"
    else:
        word = "at the limit"
    mid = peak_reserved + (outside_low + outside_high) / 2
    return {"verdict": word, "need_low": lo, "need_high": hi, "judged_fits": judged_fits,
            "margin": (device - mid) / device if device > 0 else 0.0}


def label(j: dict) -> str:
    """Short text for the verdict row: ``fits``, ``OOM``, ``limit+`` (at the limit, judged to
    fit) or ``limit-`` (at the limit, judged not to)."""
    if j["verdict"] != "at the limit":
        return j["verdict"]
    return "limit+" if j["judged_fits"] else "limit-"


def judge_stages(stages: list, outside: dict, stack: str) -> None:
    """Each stage's verdict with its band (``scale.limit``): the outside bracket's ends, the
    modern stack's or the 2020 stack's (``dryrun.stack.outside``)."""
    if outside:
        lo, hi = outside["low"], outside["high"]
    elif stack == "2020":
        lo, hi = S.paper2020().outside_bytes("low"), S.paper2020().outside_bytes("high")
    else:
        lo = hi = 0
    for s in stages:
        if s.device_capacity:
            s.limit = judge(s.live_peak, s.peak_reserved, s.device_capacity, lo, hi,
                                  s.device_fits, s.build_fits)

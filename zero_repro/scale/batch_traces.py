"""A dry run's judged trace at any micro-batch, and the search for the largest that fits (the
estimate's batch search, ``scale.estimate``; paper §5-§6: activations grow with the batch, model
states do not).

One dry run at micro-batch b = ``PRIME_BATCH``, a prime, suffices: every trace event's size is
then alpha + beta·b -- a forward or backward storage whose size is a multiple of the prime holds
b samples (activations b·s·x); every other one is constant (model states, buffers, the step's
transients; constant sizes are products of model dimensions, all smaller than the prime, or
flat-buffer counts, a multiple of it by chance 1/65521). ``BatchTraces`` writes the judged trace
at any b and replays it through the caching-allocator model (``dryrun.allocator``). Approximated:
a size affine in b with an offset (P_a's slice padding ceil(b·s·h/m) when m does not divide
s·h) is taken as constant; ``tests/unit/test_estimate.py`` holds the written trace to dry runs at
other batch sizes (``from_pair``). ``largest_batch``: a bracketing search of such judgements.
"""
from __future__ import annotations

from zero_repro.scale.dryrun import allocator as A
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.dryrun.trace import repeat_start

MAX_BATCH = 4096  # the search's ceiling
PRIME_BATCH = 65521  # the largest prime below 2^16: no product of model dimensions has it
# storages that never scale with the micro-batch, whatever their size
_CONSTANT = {S.FP16_PARAMS, S.MASTER_ADAM, S.GRAD_PARTITION, S.BUCKETS, S.GATHER}


class BatchTraces:
    """The judged trace at any micro-batch b from one dry run (module docstring: alpha_i + beta_i·b): event i's
    size is alpha_i + beta_i·b, found from the trace at b = ``PRIME_BATCH`` (``from_prime``) or
    from two traces (``from_pair``, the reference the tests hold the first to)."""

    def __init__(self, ev: list, alpha: list, beta: list):
        self.ev, self.alpha, self.beta = ev, alpha, beta
        self.rep = repeat_start(ev)

    @classmethod
    def from_prime(cls, ev: list, category_of: dict, p: int = PRIME_BATCH) -> "BatchTraces":
        """A forward / backward storage whose size at b = p is a multiple of the prime p holds
        p samples (sizes of constant storages are products of model dimensions, all < p, or
        flat-buffer counts, a multiple of p by chance 1/p); everything else is constant."""
        beta = [e[2] // p if (e[2] % p == 0 and e[3] in ("forward", "backward")
                              and category_of.get(e[1]) not in _CONSTANT) else 0 for e in ev]
        alpha = [e[2] - b * p for e, b in zip(ev, beta)]
        return cls(ev, alpha, beta)

    @classmethod
    def from_pair(cls, ev0: list, b0: int, ev1: list, b1: int) -> "BatchTraces":
        if len(ev0) != len(ev1) or any(a[0] != b[0] or a[1] != b[1] or a[3:] != b[3:]
                                       for a, b in zip(ev0, ev1)):
            raise ValueError("the traces at two batch sizes differ in their events")
        beta = [(b[2] - a[2]) / (b1 - b0) for a, b in zip(ev0, ev1)]
        return cls(ev0, [a[2] - s * b0 for a, s in zip(ev0, beta)], beta)

    def events(self, b: int) -> list:
        return [(e[0], e[1], max(0, int(round(a + s * b))), e[3], e[4])
                for e, a, s in zip(self.ev, self.alpha, self.beta)]

    def replay(self, b: int, capacity: float | None = None, stop_at_oom: bool = False):
        return A.replay(self.events(b), capacity=capacity, repeat_from=self.rep,
                        stop_at_oom=stop_at_oom)

    def fits(self, b: int, capacity: float) -> bool:
        return not self.replay(b, capacity, stop_at_oom=True).oom


def largest_batch(fits, b0: int, fits_b0: bool, seed: int, ceiling: int = MAX_BATCH
                  ) -> tuple[int, int]:
    """(largest b in [1, ceiling] with ``fits(b)`` whose b + 1 does not fit, judgements made):
    the seed and its neighbour first (when the seed is right they are the answer), then a
    gallop away from the bracket end they moved (1, 2, 4, ... from it), then bisection.
    ``fits(b0) = fits_b0`` is known. 0 when b = 1 does not fit."""
    verdict = {b0: fits_b0}

    def judge(b: int) -> bool:
        if b not in verdict:
            verdict[b] = fits(b)
        return verdict[b]

    def bounds() -> tuple[int, int]:
        lo = max(b for b, v in verdict.items() if v)
        return lo, min([b for b, v in verdict.items() if not v and b > lo] + [ceiling + 1])

    if not judge(1):
        return 0, len(verdict) - 1
    lo, hi = bounds()
    seed = min(max(seed, lo + 1), hi - 1)
    if lo < seed < hi:
        up = judge(seed)
        if lo < seed + (1 if up else -1) < hi:
            judge(seed + (1 if up else -1))
        lo, hi = bounds()
        step = 2
        while hi - lo > 1:  # gallop from the end the seed moved
            n = lo + step if up else hi - step
            if not lo < n < hi or judge(n) != up:
                lo, hi = bounds()
                break
            lo, hi = bounds()
            step *= 2
    while hi - lo > 1:
        judge((lo + hi) // 2)
        lo, hi = bounds()
    return lo, len(verdict) - 1

"""The process-level cross-check of the peers race's memory accounting: a rank's max RSS
(``max_rss``) and its resident set now (``rss``), beside the live-storage peak each framework
is measured with (``lab.live_peak.live_tracer``: the live bytes of the tensor storages it
creates). Sources: ``getrusage(2)`` (``ru_maxrss``, KiB on Linux) and ``/proc/self/statm``
(``proc(5)``: resident pages).
"""
from __future__ import annotations

import resource


def max_rss() -> int:
    """The process's peak resident set (bytes; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int:
    """The process's resident set now (bytes), from /proc/self/statm."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0

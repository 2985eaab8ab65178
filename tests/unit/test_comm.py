"""One "[rankN]: " prefix on a traceback however many process groups a process has made one after
another (torch wraps sys.excepthook at every init_process_group; ``comm._one_rank_prefix``)."""
import io
import sys

import torch.distributed as tdist

from zero_repro.runtime.comm import launch


def test_a_traceback_has_one_rank_prefix_after_many_groups():
    before = sys.excepthook
    try:
        for rank in (0, 3, 1):
            launch.init_fake(rank, 4)
            tdist.destroy_process_group()
        launch.init_fake(2, 4)
        err, sys.stderr = sys.stderr, io.StringIO()
        try:
            try:
                raise ValueError("boom")
            except ValueError:
                sys.excepthook(*sys.exc_info())
            text = sys.stderr.getvalue()
        finally:
            sys.stderr = err
        tdist.destroy_process_group()
    finally:
        sys.excepthook = before
    lines = [ln for ln in text.splitlines() if ln]
    assert lines and all(ln.startswith("[rank2]: ") for ln in lines), text
    assert not any(ln.startswith("[rank2]: [rank") for ln in lines), text
    assert "ValueError: boom" in text

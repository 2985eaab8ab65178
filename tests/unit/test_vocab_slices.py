"""Stage 3 reads a vocabulary table larger than a block a row slice at a time
(``zero.slice_vocab_gather``, ``runtime.model.tp.RowSource``): the lookup and the tied head give
the values of the whole table, the training matches the AdamW reference at DP 2 and at TP 2 ×
DP 2, C_B on and off, the gathered working set is at most two slices beside the blocks, and the
price is the one written down: the table gathered twice more per step.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zero_repro.config import ModelConfig, padded_vocab
from zero_repro.runtime.comm.launch import spawn
from zero_repro.runtime.model.gpt import GPT
from zero_repro.runtime.model.tp import RowSource
from tests.unit.test_zero_equivalence import WIDE, check_equivalence, worker

CFG_OFF = {"zero_r": {"constant_buffers": False, "contiguous_memory": False}}


class _Cuts(RowSource):
    """A plain table cut at the given rows (uneven slices); counts the slices handed out."""

    def __init__(self, table: torch.Tensor, cuts: list[int]):
        self.table, self.cuts, self.handed = table, [0, *cuts, table.shape[0]], 0

    def slices(self, reverse: bool = False):
        pairs = list(zip(self.cuts, self.cuts[1:]))
        for r0, r1 in (pairs[::-1] if reverse else pairs):
            self.handed += 1
            yield r0, r1, self.table[r0:r1].detach().clone()


def test_sliced_lookup_and_head_equal_the_whole_table():
    """Lookup exact, head and every gradient within rounding, through the GPT's own forward."""
    cfg = ModelConfig(n_layer=1, n_embd=16, n_head=2, seq_len=8, vocab_size=100,
                      vocab_pad_multiple=4)
    whole, sliced = GPT(cfg), GPT(cfg)
    whole.init_weights(3)
    sliced.load_state_dict(whole.state_dict())
    src = _Cuts(sliced.wte.weight, [7, 40, 41])
    sliced.wte.row_source = src
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len),
                        generator=torch.Generator().manual_seed(0))
    assert torch.equal(sliced.wte(idx), F.embedding(idx, whole.wte.weight))
    src.handed = 0
    (la, a), (lb, b) = whole(idx, idx), sliced(idx, idx)
    a.backward()
    b.backward()
    assert src.handed == 3 * 4  # lookup, head forward, head backward: every slice once each
    torch.testing.assert_close(lb, la, rtol=1e-6, atol=1e-6)
    for (n, p), q in zip(whole.named_parameters(), sliced.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)


def _configs(tp: int) -> list[dict]:
    cs = [{"model": "gpt_wide", "stage": 3, "tp": tp, "steps": 3}]
    cs.append({**cs[0], "sliced": False, "compare": False, "steps": 2})
    if tp == 1:
        cs.append({**cs[0], **CFG_OFF})
        cs.append({**cs[1], **CFG_OFF})
    return cs


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)])
def test_stage3_sliced_table_matches_adamw_and_costs_two_gathers(world, tp):
    configs = _configs(tp)
    results = spawn(worker, world, configs)
    compared = [i for i, c in enumerate(configs) if c.get("compare", True)]
    check_equivalence([[r[i] for i in compared] for r in results], [configs[i] for i in compared])
    local_table = padded_vocab(WIDE, tp) * WIDE.n_embd // tp  # this rank's rows of the table
    block = 12 * WIDE.n_embd ** 2 + 13 * WIDE.n_embd
    for rank_results in results:
        by = {(c.get("sliced", True), "zero_r" in c): r for c, r in zip(configs, rank_results)}
        for cb_off in ([False, True] if tp == 1 else [False]):
            on, off = by[(True, cb_off)], by[(False, cb_off)]
            # a step in steady state (the second: the first gathers the whole table in forward
            # and again for the next step) reads the table three times (lookup, head forward,
            # head backward) vs once (gathered inside the step before, kept for backward)
            assert on["comm"][1]["dp"] - off["comm"][1]["dp"] == 2 * local_table, (cb_off, on, off)
            g_on, g_off = on["ledger"]["params_gathered"], off["ledger"]["params_gathered"]
            assert g_off >= 4 * local_table  # the whole table at once
            # two slices of at most a block each + the blocks/roots the forward holds
            assert g_on <= g_off - 4 * local_table + 2 * 4 * block, (cb_off, g_on, g_off)
            assert on["ledger"]["comm_buffers"] <= off["ledger"]["comm_buffers"], cb_off

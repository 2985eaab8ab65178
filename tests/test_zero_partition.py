"""Pure shard arithmetic (zero/partition.py): every element owned exactly once, buckets within
capacity, padding < N_d, ownership ranges consistent with shard offsets."""
from __future__ import annotations

import pytest

from zero_repro.runtime.zero.partition import Partition, counted_subranges, layout, padded_numel


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", [1, 5, 12, 97, 1000, 4099])
@pytest.mark.parametrize("cap", [1, 6, 64, 10_000])
def test_partition_covers_each_element_once(world, numel, cap):
    p = Partition(numel, world, cap)
    assert 0 <= p.padding < world
    assert p.padded_numel == p.shard_numel * world
    owner = [None] * p.padded_numel
    for r in range(world):
        seen_shard = 0
        for flat_start, shard_start, length in p.shard_ranges(r):
            assert shard_start == seen_shard  # a rank's chunks tile its shard in order
            seen_shard += length
            for i in range(flat_start, flat_start + length):
                assert owner[i] is None
                owner[i] = r
        assert seen_shard == p.shard_numel
    assert None not in owner
    for b in p.buckets:
        assert b.size % world == 0 and b.size == b.chunk * world
        assert b.size <= max(cap - cap % world, world)  # constant capacity (C_B)
    assert sum(p.real_in_bucket(b) for b in p.buckets) == numel


def test_layout_and_counted_ranges():
    slots, total = layout(["a", "b", "c"], [(2, 3), (4,), (1, 1)])
    assert total == 11 and [s.offset for s in slots] == [0, 6, 10]
    assert counted_subranges(slots, {"b"}, 5, 11) == [(1, 5)]
    assert counted_subranges(slots, {"a", "c"}, 5, 11) == [(0, 1), (5, 6)]
    assert padded_numel(10, 3) == 12


def test_buckets_of_finds_straddling_parameter():
    p = Partition(100, 2, 20)
    assert [b.index for b in p.buckets_of(15, 10)] == [0, 1]

"""Pure shard arithmetic (zero/partition.py): every element owned exactly once, buckets within
capacity, padding < N_d, ownership ranges consistent with shard offsets; the two bucket knobs
each bound what they name (gradient buckets R, gather buckets A)."""
from __future__ import annotations

import pytest

from zero_repro.runtime.zero.partition import (Partition, counted_subranges, geometry, layout,
                                               padded_numel)


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
    assert sum(p.real_in(b) for b in p.buckets) == numel


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("r,a", [(60, 60), (60, 20), (20, 60), (50, 20), (7, 1000)])
def test_gradient_and_gather_buckets_each_follow_their_knob(world, r, a):
    p = Partition(997, world, r, a)
    for runs, cap in ((p.grad_buckets, r), (p.gather_buckets, a)):
        # runs of whole buckets tiling the flat buffer in order, each within its knob
        assert [s.first for s in runs] == [0] + [s.stop for s in runs[:-1]]
        assert runs[-1].stop == len(p.buckets) and runs[-1].end == p.padded_numel
        for s in runs:
            assert s.start == p.buckets[s.first].start and s.end == p.buckets[s.stop - 1].end
            assert s.size <= max(cap, p.buckets[s.first].size)
    # one of the two is always single buckets: the grid is the smaller knob
    assert all(s.stop - s.first == 1 for s in p.grad_buckets) or \
        all(s.stop - s.first == 1 for s in p.gather_buckets)
    assert p.capacity == max(s.size for s in p.grad_buckets)


def test_layout_and_counted_ranges():
    slots, total = layout(["a", "b", "c"], [(2, 3), (4,), (1, 1)])
    assert total == 11 and [s.offset for s in slots] == [0, 6, 10]
    assert counted_subranges(slots, {"b"}, 5, 11) == [(1, 5)]
    assert counted_subranges(slots, {"a", "c"}, 5, 11) == [(0, 1), (5, 6)]
    assert padded_numel(10, 3) == 12


def test_buckets_of_finds_straddling_parameter():
    p = Partition(100, 2, 20)
    assert [b.index for b in p.buckets_of(15, 10)] == [0, 1]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", [1, 5, 12, 97, 1000, 4099])
@pytest.mark.parametrize("r,a", [(1, 1), (6, 6), (64, 64), (10_000, 10_000), (64, 6), (6, 64),
                                 (50, 20), (21, 7), (1 << 62, 1 << 62)])
def test_geometry_counts_what_the_partition_builds(world, numel, r, a):
    p, g = Partition(numel, world, r, a), geometry(numel, world, r, a)
    assert g.buckets == len(p.buckets)
    assert g.chunk == max(b.chunk for b in p.buckets)
    assert g.grad_buckets == len(p.grad_buckets) and g.capacity == p.capacity

"""Pinned memory for streamed blocks: torch's pinned allocator rounds each request up to a power of two, so
blocks are carved from power-of-two slabs that hold several of them, and the budget is charged what is pinned."""

import torch

from h3_core.pinned import GIB, MAX_SLAB, PinnedSlabs, slab_bytes

MIB = 2**20
BF16_BLOCK, FP8_BLOCK, NVFP4_BLOCK = 735 * MIB, 368 * MIB, 207 * MIB  # the real config's (memory_plan)


def test_a_slab_wastes_little_of_itself_within_the_largest_asked():
    assert slab_bytes(BF16_BLOCK, 48, None) == 8 * GIB  # eleven blocks: 1.3% spare, not 39% a block
    assert slab_bytes(FP8_BLOCK, 48, None) == 8 * GIB  # twenty-two, 1.2%
    assert slab_bytes(NVFP4_BLOCK, 48, None) <= MAX_SLAB
    assert slab_bytes(BF16_BLOCK, 1, None) == GIB  # the last block alone: the least it can take
    assert slab_bytes(BF16_BLOCK, 7, None) == 4 * GIB  # seven: 4 then 2 GiB hold them, not 8 GiB
    assert slab_bytes(BF16_BLOCK, 48, 6 * GIB) == 4 * GIB  # within the room: 4 + 2 GiB hold seven
    assert slab_bytes(BF16_BLOCK, 48, GIB - 1) is None  # not even one


def _fake_pin(taken):
    def allocate(nbytes):
        taken.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)
    return allocate


def test_blocks_are_carved_from_slabs_and_the_room_is_charged_whole_slabs():
    taken = []
    slabs = PinnedSlabs(20 * GIB, _fake_pin(taken))
    pieces = [slabs.take(100 * MIB, 30 - i) for i in range(30)]
    got = [piece for piece in pieces if piece is not None]
    assert taken and sum(taken) <= 20 * GIB and slabs.pinned_bytes == sum(taken)
    assert len(got) * 100 * MIB > 0.9 * sum(taken)  # within 10% of what is pinned: not ~28% per block
    assert all(piece.numel() == 100 * MIB for piece in got)
    bases = {}
    for piece in got:  # slices of slabs, never overlapping, each a whole number of pages into its slab
        start, base = piece.data_ptr(), piece.untyped_storage().data_ptr()
        assert (start - base) % 4096 == 0
        bases.setdefault(base, []).append((start, start + piece.numel()))
    assert len(bases) == len(taken)
    for spans in bases.values():
        spans.sort()
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert pieces[len(got):] == [None] * (30 - len(got))  # once the room is spent: the rest are not pinned


def test_no_room_limit_pins_every_block():
    taken = []
    slabs = PinnedSlabs(None, _fake_pin(taken))
    assert all(slabs.take(BF16_BLOCK, 20 - i) is not None for i in range(20))
    assert sum(taken) == 16 * GIB  # 8 + 8 (11 + 9 blocks), the fewest powers of two that hold 20; 20 GiB a block
    # at a time


def test_tables_are_parked_as_they_are_in_slices_of_a_few_slabs():
    from h3_core.pinned import park_table

    taken = []
    slabs = PinnedSlabs(None, _fake_pin(taken))
    tables = [torch.randn(2, 6 * 96, dtype=dtype) for dtype in (torch.bfloat16, torch.float32) for _ in range(15)]
    parked = [park_table(slabs, table, 15 - index % 15) for index, table in enumerate(tables)]
    assert all(p.dtype == t.dtype and torch.equal(p, t) for p, t in zip(parked, tables))
    assert len({p.untyped_storage().data_ptr() for p in parked}) == len(taken) < 10  # slabs, not 30 buffers
    assert sum(taken) == 15 * 4096 + 15 * 8192  # each table a page or two: nothing rounded up past that

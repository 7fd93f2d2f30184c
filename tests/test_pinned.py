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


def test_a_pin_the_driver_refuses_leaves_the_rest_unpinned(caplog):
    """cudaHostAlloc can fail below what the host has free (WSL2's limit, say): the whole placement failed; the
    blocks (and AdaLN tables) now stay in ordinary memory, asked once."""
    from h3_core.pinned import park_table

    asked = []

    def refused(capacity):
        asked.append(capacity)
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")

    slabs = PinnedSlabs(None, refused)
    with caplog.at_level("WARNING", logger="h3_core"):
        assert [slabs.take(BF16_BLOCK, 5 - i) for i in range(5)] == [None] * 5
    assert len(asked) == 1 and slabs.pinned_bytes == 0
    assert "pinned memory could not be had (CUDA error: out of memory); what was to go there streams" in caplog.text
    table = torch.randn(2, 96)
    assert torch.equal(park_table(slabs, table, 1), table) and len(asked) == 1


def test_tables_are_parked_as_they_are_in_slices_of_a_few_slabs():
    from h3_core.pinned import park_table

    taken = []
    slabs = PinnedSlabs(None, _fake_pin(taken))
    tables = [torch.randn(2, 6 * 96, dtype=dtype) for dtype in (torch.bfloat16, torch.float32) for _ in range(15)]
    parked = [park_table(slabs, table, 15 - index % 15) for index, table in enumerate(tables)]
    assert all(p.dtype == t.dtype and torch.equal(p, t) for p, t in zip(parked, tables))
    assert len({p.untyped_storage().data_ptr() for p in parked}) == len(taken) < 10  # slabs, not 30 buffers
    assert sum(taken) == 15 * 4096 + 15 * 8192  # each table a page or two: nothing rounded up past that


def test_a_host_is_told_of_each_slab_taken_and_given_back(monkeypatch):
    """ComfyUI budgets pinned memory itself: H3's slabs were pinned beside its count, so its own pins and ours
    could each take the whole budget. The host is now told of each slab when taken and when its last slice goes."""
    from h3_core import pinned

    counted = []
    monkeypatch.setattr(pinned, "host", pinned.HostPins(lambda: None, counted.append))
    taken = []
    slabs = PinnedSlabs(None, _fake_pin(taken))
    pieces = [slabs.take(BF16_BLOCK, 14 - i) for i in range(14)]
    assert counted == taken and sum(taken) == slabs.pinned_bytes and taken[0] == 8 * GIB  # eleven blocks, then 3
    del slabs
    held = pieces[:11]  # the first slab's blocks
    pieces = None
    assert counted[:len(taken)] == taken and sorted(counted[len(taken):]) == sorted(-n for n in taken[1:])
    view = held[-1][:10].view(torch.int16)
    held = None
    assert sum(counted) == taken[0]  # a view of a slice keeps its slab counted
    view = None
    assert sum(counted) == 0 and len(counted) == 2 * len(taken)


def test_a_table_past_the_room_is_parked_in_ordinary_memory():
    """A schedule's tables ignored the host's pinned-memory room (ComfyUI's --disable-pinned-memory too): those
    the room cannot hold now wait in ordinary CPU memory, the same values."""
    from h3_core.pinned import park_table

    taken = []
    slabs = PinnedSlabs(8192, _fake_pin(taken))  # two tables, a page each
    tables = [torch.randn(2, 6 * 96, dtype=torch.bfloat16) for _ in range(4)]
    parked = [park_table(slabs, table, 4 - index) for index, table in enumerate(tables)]
    assert taken == [8192] and all(torch.equal(p, t) for p, t in zip(parked, tables))
    in_slab = {p.untyped_storage().data_ptr() for p in parked[:2]}
    assert len(in_slab) == 1 and all(p.untyped_storage().data_ptr() not in in_slab for p in parked[2:])

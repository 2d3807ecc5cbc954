"""The paged KV cache's bookkeeping: tables, sharing, prefix hits, eviction, copy-on-write."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.prefix import prefix_names
from worker.generate.blocks import NULL_BLOCK, BlockManager

BS = 4


def manager(blocks: int = 32, caching: bool = True) -> BlockManager:
    return BlockManager(blocks, BS, caching, namespace=b"model")


def run(m: BlockManager, key: int, tokens: list[int], generated: list[int] = ()) -> int:
    """Admit a prompt, decode `generated` after it, commit each step like the engine."""
    cached = m.admit(key, tokens)
    m.commit([key])
    for token in generated:
        m.append(key, token)
        m.commit([key])
    return cached


def test_a_table_covers_every_position_and_never_uses_the_null_block() -> None:
    m = manager()
    run(m, 1, list(range(10)))
    table = m.table(1)
    assert len(table) == 3 and NULL_BLOCK not in table
    assert [m.slot(1, p) for p in (0, 4, 9)] == [table[0] * BS, table[1] * BS, table[2] * BS + 1]


def test_decoding_takes_a_new_block_exactly_when_a_position_starts_one() -> None:
    m = manager()
    m.admit(1, [1, 2, 3])
    sizes = []
    for token in range(4, 11):  # positions 3..9
        assert m.append(1, token) is None  # a sole owner: never a copy
        sizes.append(len(m.table(1)))
    assert sizes == [1, 2, 2, 2, 2, 3, 3]  # positions 4 and 8 open blocks 2 and 3
    assert len(set(m.table(1))) == 3 and NULL_BLOCK not in m.table(1)


def test_a_second_prompt_with_the_same_prefix_reuses_its_full_blocks() -> None:
    m = manager()
    assert run(m, 1, list(range(10))) == 0
    assert run(m, 2, [*range(8), 99, 98]) == 8  # two full blocks shared
    assert m.table(2)[:2] == m.table(1)[:2]
    assert m.table(2)[2] != m.table(1)[2]
    assert (m.stats.queried_tokens, m.stats.hit_tokens) == (20, 8)


def test_the_last_prompt_token_is_always_recomputed() -> None:
    m = manager()
    run(m, 1, list(range(8)))
    assert m.cached_tokens(list(range(8))) == 4  # not 8: its logits are needed


def test_a_finished_sequence_leaves_prompt_and_output_cached_for_the_next_turn() -> None:
    m = manager()
    prompt, reply = list(range(6)), [50, 51, 52, 53, 54]
    run(m, 1, prompt, reply)  # 11 tokens in the cache
    m.free(1)
    next_turn = [*prompt, *reply, 60, 61, 62]
    assert m.cached_tokens(next_turn) == 8
    assert run(m, 2, next_turn) == 8


def test_a_different_namespace_or_token_never_hits() -> None:
    m = manager()
    run(m, 1, list(range(9)))
    assert m.cached_tokens([0, 1, 2, 7, 4, 5, 6, 7, 8]) == 0
    other = BlockManager(32, BS, namespace=b"other")
    assert prefix_names(list(range(8)), BS, b"model") != other.names(list(range(8)))


def test_a_hash_collision_costs_a_recompute_never_a_wrong_block() -> None:
    m = manager()
    run(m, 1, list(range(9)))
    names = m.names(list(range(9)))
    assert m.cached_tokens([9, 9, 9, 9, 9, 9, 9, 9, 9], names) == 0  # names lie, tokens differ


def test_caching_off_names_nothing() -> None:
    m = manager(caching=False)
    run(m, 1, list(range(9)))
    m.free(1)
    assert run(m, 2, list(range(9))) == 0
    assert m.stats.queried_tokens == 0


def test_freed_named_blocks_are_reused_last_and_tails_evicted_first() -> None:
    m = manager(blocks=7)  # six usable
    run(m, 1, list(range(12)))  # three named blocks
    m.free(1)
    run(m, 2, [100, 101, 102, 103, 104])  # two blocks: both from never-used ids
    assert m.stats.evictions == 0
    m.free(2)
    run(m, 3, [200] * 12)  # takes 1 unnamed + 1 named + more: the tail goes first
    assert m.stats.evictions >= 1
    assert m.cached_tokens(list(range(5))) == 4  # the head block survived


def test_siblings_share_blocks_until_one_writes_then_copy_on_write() -> None:
    m = manager()
    m.admit(1, list(range(6)))
    m.commit([1])
    m.fork(1, 2)
    assert m.table(1) == m.table(2)
    assert m.append(1, 7) is not None  # the shared partial block is copied for the writer
    assert m.append(2, 8) is None  # the other is now its only owner
    assert m.table(1)[0] == m.table(2)[0]  # the full block stays shared
    assert m.table(1)[1] != m.table(2)[1]
    assert m.stats.copies == 1


def test_admitting_past_the_pool_is_refused_and_leaves_it_unchanged() -> None:
    m = manager(blocks=4)  # three usable
    run(m, 1, list(range(8)))
    with pytest.raises(MemoryError):
        m.admit(2, [*range(4), 50, 51, 52, 53, 54])  # needs 2 new beyond the shared one
    assert m.used == 2
    m.free(1)
    assert m.used == 0


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "append", "fork", "free"]),
        st.integers(0, 5),
        st.lists(st.integers(0, 3), min_size=1, max_size=14),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_schedules_keep_the_pool_consistent(schedule) -> None:
    """Every live position has one slot; a slot two sequences share holds the same token
    at the same position; refs match the tables; used + free = the pool."""
    m = manager(blocks=24)
    live: dict[int, list[int]] = {}
    for op, key, tokens in schedule:
        if op == "admit" and key not in live:
            try:
                m.admit(key, tokens)
            except MemoryError:
                continue
            m.commit([key])
            live[key] = list(tokens)
        elif op == "append" and key in live:
            try:
                m.append(key, tokens[0])
            except MemoryError:
                live[key].append(tokens[0])  # the manager recorded the token before failing
                m.free(key)
                del live[key]
                continue
            m.commit([key])
            live[key].append(tokens[0])
        elif op == "fork" and key in live and key + 10 not in live:
            m.fork(key, key + 10)
            live[key + 10] = list(live[key])
        elif op == "free" and key in live:
            m.free(key)
            del live[key]
        check_consistent(m, live)


def check_consistent(m: BlockManager, live: dict[int, list[int]]) -> None:
    holder: dict[int, tuple[int, int]] = {}
    for k, toks in live.items():
        assert m.length(k) == len(toks)
        for p, t in enumerate(toks):
            slot = m.slot(k, p)
            assert slot // BS != NULL_BLOCK
            if slot in holder:
                assert holder[slot] == (p, t), "two sequences wrote one slot differently"
            holder[slot] = (p, t)
    refs: dict[int, int] = {}
    for k in live:
        for b in m.table(k):
            refs[b] = refs.get(b, 0) + 1
    assert len(refs) == m.used
    assert all(m._refs[b] == n for b, n in refs.items())


def test_a_pool_too_small_to_hold_anything_is_refused_and_two_blocks_is_enough() -> None:
    for blocks, size in ((1, 4), (2, 0)):
        with pytest.raises(ValueError, match="needs a block size and at least one usable"):
            BlockManager(blocks, size)
    smallest = BlockManager(2, 1)  # the null block and one usable block of one position
    assert smallest.usable == 1 and smallest.used == 0
    assert smallest.admit(1, [7]) == 0 and smallest.table(1) != [NULL_BLOCK]


def test_the_stats_count_what_happened_each_time() -> None:
    m = manager(blocks=3, caching=True)  # two usable blocks of four positions
    run(m, 1, list(range(8)))  # two full blocks, named
    m.free(1)
    assert (m.stats.queried_tokens, m.stats.hit_tokens, m.stats.evictions) == (8, 0, 0)
    assert m.admit(2, [*range(8), 50][:8]) == 4  # the last token is always recomputed
    m.free(2)
    assert (m.stats.queried_tokens, m.stats.hit_tokens) == (16, 4)
    assert m.admit(3, list(range(8)), reuse=False) == 0  # asked not to reuse: no hit counted
    assert m.stats.hit_tokens == 4 and m.stats.evictions == 2  # both named blocks reused
    m.free(3)


def test_exactly_enough_free_blocks_admit_and_one_fewer_refuses_with_the_numbers() -> None:
    m = manager(blocks=4, caching=False)  # three usable
    m.admit(1, list(range(12)))  # all three
    m.free(1)
    m.admit(2, list(range(8)))  # two of three
    with pytest.raises(MemoryError, match="2 blocks needed, 1 free"):
        m.admit(3, list(range(8)))
    assert m.admit(4, list(range(4))) == 0  # the last one: exactly enough
    with pytest.raises(KeyError, match="sequence 4 already holds blocks"):
        m.admit(4, [1])


def test_copy_on_write_counts_each_copy_and_keeps_the_sibling_s_block() -> None:
    m = manager()
    run(m, 1, [1, 2, 3, 4, 5, 6])  # the last block half full
    m.fork(1, 2)
    shared = m.table(1)[-1]
    copied = m.append(2, 7)
    assert copied is not None and copied[0] == shared and m.table(1)[-1] == shared
    assert m.table(2)[-1] == copied[1] != shared and m.stats.copies == 1
    assert m.append(2, 8) is None  # its own block now: no second copy
    assert m.stats.copies == 1
    assert m.append(1, 9) is None  # the sibling owns the shared block alone again


def test_names_passed_to_cached_tokens_are_the_ones_looked_up() -> None:
    """Precomputed names are used as given, not recomputed from the tokens."""
    m = manager()
    run(m, 1, list(range(9)))
    assert m.cached_tokens(list(range(9)), m.names(list(range(9)))) == 8
    assert m.cached_tokens(list(range(9)), prefix_names(list(range(9)), BS, b"other")) == 0


def test_a_sequence_that_reused_a_prefix_names_its_later_blocks_in_the_same_chain() -> None:
    """After two cached blocks, the third block this sequence fills gets the chained name."""
    m = manager()
    run(m, 1, list(range(9)))  # blocks 0..3 and 4..7 named
    assert run(m, 2, list(range(13))) == 8  # names 8..11 after the two it reused
    assert m.cached_tokens(list(range(13))) == 12


def test_a_forked_sibling_continues_its_parent_s_chain_of_names() -> None:
    """A fork inherits how many blocks are named and the last name, so its next full block
    is named as the same prefix would be."""
    m = manager()
    run(m, 1, list(range(6)))
    m.fork(1, 2)
    m.append(2, 6)
    m.append(2, 7)
    m.commit([2])
    assert m.cached_tokens([*range(8), 99]) == 8


def test_three_siblings_each_copy_the_shared_block_before_writing_until_one_is_left() -> None:
    """Copy-on-write drops one reference per copy: the second writer of three copies too,
    the copy replaces the last block only, and each copy is counted."""
    m = manager()
    run(m, 1, list(range(10)))  # three blocks, the last half full
    m.fork(1, 2)
    m.fork(1, 3)
    head, shared = m.table(1)[:2], m.table(1)[2]
    first = m.append(2, 50)
    second = m.append(3, 60)
    assert first is not None and second is not None
    assert (first[0], second[0]) == (shared, shared)
    assert m.table(2) == [*head, first[1]] and m.table(3) == [*head, second[1]]
    assert m.append(1, 70) is None and m.table(1) == [*head, shared]
    assert m.stats.copies == 2


def test_commit_with_written_names_only_the_blocks_prefilled_so_far() -> None:
    """A prompt prefilled in chunks names only the full blocks of its written positions."""
    m = manager()
    m.admit(1, list(range(12)))
    m.commit([1], written=[5])  # one full block written
    assert m.cached_tokens([*range(12), 99]) == 4
    m.commit([1], written=[12])
    assert m.cached_tokens([*range(12), 99]) == 12


def test_of_two_blocks_with_the_same_prefix_the_first_named_keeps_the_name() -> None:
    """Two equal prompts admitted in one step: the first commit names its block; the other
    block stays unnamed and is handed out again before any cached block is evicted."""
    m = manager(blocks=3)  # two usable
    m.admit(1, [0, 1, 2, 3])
    m.admit(2, [0, 1, 2, 3])
    first, second = m.table(1)[0], m.table(2)[0]
    m.commit([1, 2])
    m.free(1)
    m.free(2)
    assert m.admit(3, [0, 1, 2, 3, 9]) == 4
    assert m.table(3) == [first, second] and m.stats.evictions == 0


def test_freeing_an_unknown_sequence_does_nothing() -> None:
    """A sequence freed twice (cancelled, then finished) or never admitted is ignored."""
    m = manager()
    run(m, 1, list(range(5)))
    m.free(1)
    m.free(1)
    m.free(99)
    assert m.used == 0


def test_high_water_counts_the_ids_ever_handed_out() -> None:
    """`high_water` is one past the highest block id used; reused blocks leave it unchanged."""
    m = manager(caching=False)
    assert m.high_water == 1
    m.admit(1, list(range(9)))  # three blocks: ids 1, 2, 3
    assert m.high_water == 4
    m.free(1)
    m.admit(2, list(range(9)))  # the same three ids again
    assert m.high_water == 4


def test_eviction_takes_the_least_recently_freed_block_first() -> None:
    """A freed sequence releases its tail first, so its tail is evicted first and the head
    of the prefix stays cached."""
    m = manager(blocks=4)  # three usable
    run(m, 1, list(range(12)))  # three named blocks
    tail = m.table(1)[2]
    m.free(1)
    run(m, 2, [100, 101, 102, 103])  # one block, and no never-used id left
    assert m.table(2) == [tail] and m.stats.evictions == 1
    assert m.cached_tokens([*range(8), 99]) == 8

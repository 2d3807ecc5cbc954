"""Cache-aware routing policy: the longest known prefix names the worker, within a bound."""

from __future__ import annotations

from gateway.affinity import ROUTING_BLOCK, AffinityRouter, PrefixIndex, choose, names_of

SYSTEM = list(range(3, 3 + 4 * ROUTING_BLOCK))


def test_the_longest_known_prefix_names_the_worker() -> None:
    index = PrefixIndex()
    index.learn(names_of(SYSTEM[: 2 * ROUTING_BLOCK], "m", None), "a")
    index.learn(names_of(SYSTEM, "m", None), "b")
    assert index.owner(names_of([*SYSTEM, 1, 2, 3], "m", None)) == ("b", 4)
    other = names_of([*SYSTEM[:ROUTING_BLOCK], *range(900, 1000)], "m", None)
    assert index.owner(other) == ("b", 1)  # b answered last for the shared first block


def test_names_depend_on_the_model_and_the_whole_prefix() -> None:
    assert names_of(SYSTEM, "m", None) != names_of(SYSTEM, "n", None)
    shifted = names_of([0, *SYSTEM[1:]], "m", None)
    assert not set(shifted) & set(names_of(SYSTEM, "m", None))
    assert names_of(SYSTEM[: ROUTING_BLOCK - 1], "m", None) == []  # no full block, no name


def test_a_session_key_routes_by_itself() -> None:
    index = PrefixIndex()
    index.learn(names_of([1, 2], "m", "conv-7"), "a")
    assert index.owner(names_of(SYSTEM, "m", "conv-7")) == ("a", 1)
    assert index.owner(names_of(SYSTEM, "m", "conv-8")) == (None, 0)


def test_the_index_forgets_the_least_recently_used_first() -> None:
    index = PrefixIndex(capacity=2)
    first, second = names_of(SYSTEM, "m", None)[:2], names_of(SYSTEM, "n", None)[:2]
    index.learn(first, "a")
    index.learn(second, "b")
    assert index.owner(first) == (None, 0)
    assert index.owner(second) == ("b", 2)


def test_affinity_yields_past_the_imbalance_bound_or_to_a_worker_gone() -> None:
    assert choose("a", {"a": 5, "b": 1}, max_imbalance=4) == "a"
    assert choose("a", {"a": 6, "b": 1}, max_imbalance=4) is None
    assert choose("c", {"a": 0, "b": 0}, max_imbalance=4) is None  # not live
    assert choose(None, {"a": 0}, max_imbalance=4) is None


def test_the_router_counts_what_it_sent_until_it_is_answered() -> None:
    router = AffinityRouter(max_imbalance=2)
    names = names_of(SYSTEM, "m", None)
    router.learn(names, "a")
    router.update_loads("m", {"a": 0, "b": 0})
    assert [router.route("m", names) for _ in range(4)] == ["a", "a", "a", None]
    router.answered("m", "a")
    assert router.loads("m") == {"a": 2, "b": 0}
    assert router.route("m", names) == "a"
    router.update_loads("m", {"a": 0, "b": 3})  # b got busy with shared work
    assert router.loads("m") == {"a": 3, "b": 3}
    assert router.route("other", names) is None  # no live worker known for that model


def test_answers_count_down_to_zero_and_never_below() -> None:
    """... and a count that reaches zero is dropped: the map holds only prompts out."""
    router = AffinityRouter(max_imbalance=8)
    names = names_of(SYSTEM, "m", None)
    router.learn(names, "a")
    router.update_loads("m", {"a": 0})
    router.route("m", names)
    router.route("m", names)
    router.answered("m", "a")
    assert router.loads("m") == {"a": 1}
    assert router._in_flight == {("m", "a"): 1}
    router.answered("m", "a")
    assert router.loads("m") == {"a": 0}
    assert router._in_flight == {}
    router.answered("m", "a")  # a late or duplicate answer: still none in flight, not -1
    assert router.loads("m") == {"a": 0}
    assert router._in_flight == {}  # and adds nothing back
    router.answered("m", "b")  # a worker it never sent to
    assert router.loads("m") == {"a": 0}


def test_session_names_are_one_16_byte_name_per_model_and_session() -> None:
    [first] = names_of(SYSTEM, "m", "s1")
    assert len(first) == 16
    assert names_of([1, 2], "m", "s1") == [first]  # the prompt does not matter
    assert names_of(SYSTEM, "m", "s2") != [first] and names_of(SYSTEM, "n", "s1") != [first]


def test_a_worker_known_from_the_store_wins_over_this_gateways_index_within_the_bound() -> None:
    """A stored response names the worker that answered it: another gateway, whose own index
    never saw the conversation (or saw an older turn elsewhere), routes the next turn there,
    unless that worker is overloaded or gone."""
    router = AffinityRouter(max_imbalance=2)
    names = names_of(SYSTEM, "m", None)
    router.learn(names, "a")
    router.update_loads("m", {"a": 0, "b": 0})
    assert router.route("m", names, known="b") == "b"
    assert router.route("m", names_of([9, 9, 9], "m", None), known="b") == "b"  # index blind
    assert router.route("m", names, known="gone") is None
    router.update_loads("m", {"a": 0, "b": 5})
    assert router.route("m", names, known="b") is None


def test_only_workers_that_read_tenants_affinity_streams_are_sent_a_tenants_prompts_there() -> None:
    """A worker of an earlier release reads only its own affinity stream: a tenant's prompt
    routed to it must go there, not to a tenant stream nobody reads."""
    router = AffinityRouter(max_imbalance=4)
    router.update_loads("m", {"new": 0, "old": 0}, frozenset({"new"}))
    assert router.reads_lanes("m", "new")
    assert not router.reads_lanes("m", "old")
    assert not router.reads_lanes("other", "new")
    router.update_loads("m", {"new": 0, "old": 0})  # a refresh that found none: none
    assert not router.reads_lanes("m", "new")

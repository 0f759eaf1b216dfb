"""``TierScheduler`` with the disk and the store under the host tier, against the calls vLLM
makes: which blocks they serve, loads asynchronous or (small, from the disk) before the
forward, puts to the stores lacking a block, what loads count served, prefill/decode roles."""

from __future__ import annotations

import pytest

from atb_mem.integrations.vllm.scheduler import HOST, Scheduled, TierScheduler
from tests.integrations.vllm.fakes import FakeStore
from tests.integrations.vllm.scheduler_calls import ID, keys, make, prefill, words


def test_store_loads_are_asynchronous_and_puts_go_to_stores_lacking_the_block() -> None:
    disk, mooncake = FakeStore("DISK"), FakeStore("MOONCAKE")
    writer = make(stores=[disk, mooncake])
    a = list(range(400))
    moves = prefill(writer, "a", a, [1, 2, 3, 4])
    assert [(host, names) for host, _, _, _, names in moves.puts] == \
        [(True, ("DISK", "MOONCAKE"))] * 3
    assert [(high, low) for _, _, high, low, _ in moves.puts] == words(writer, a)
    key = keys(writer, a)
    disk.data.update({key[0]: b"0", key[1]: b"1"})  # what the workers put
    mooncake.data[key[0]] = b"0"
    disk.exists_calls.clear()

    sched = make(stores=[disk, mooncake])  # another engine: an empty host tier
    assert sched.lookup("b", list(a), 0) == (256, True)
    assert disk.exists_calls == [key[:3]], "one batched call for the blocks before the last"
    sched.allocated("b", [20, 21, 22, 23], 256)
    assert sched.hit_tokens("b") == {"DISK": 256}
    moves = sched.build([], idle=True)
    assert moves.idle and not moves.host_loads
    assert moves.store_loads == {"b": [(*words(sched, a)[0], 20), (*words(sched, a)[1], 21)]}
    sched.allocated("b", [20, 21, 22, 23], 0)  # again, once the load ended: nothing new
    moves = sched.build([Scheduled("b", 256, 144, [20, 21, 22, 23], True)])
    assert not moves.store_loads and not moves.host_loads
    assert [block for block, _ in moves.saves] == [20, 21, 22]  # the host keeps them too
    assert [(index, names) for index, (_, _, *_, names) in enumerate(moves.puts)] == \
        [(0, ("MOONCAKE",)), (1, ("DISK", "MOONCAKE"))]
    assert [(h, lo) for _, _, h, lo, _ in moves.puts] == words(sched, a)[1:3]
    # The host has the three blocks now; vLLM's own cache covers two of them.
    assert sched.lookup("c", list(a), 256) == (128, False)
    sched.allocated("c", [30, 31, 32, 33], 128)
    moves = sched.build([])
    assert [block for _, block in moves.host_loads] == [32] and not moves.store_loads


def test_a_store_run_stops_at_a_missing_block_or_a_missing_rank() -> None:
    disk = FakeStore("DISK")
    sched = make(num_host_blocks=0, stores=[disk], identities=["m-tp0", "m-tp1"])
    a = list(range(600))
    k0, k1 = keys(sched, a, "m-tp0"), keys(sched, a, "m-tp1")
    disk.data.update(dict.fromkeys([k0[0], k1[0], k0[1], k0[2], k1[2]], b""))
    assert sched.lookup("a", a, 0) == (128, True), "block 1 lacks rank 1's shard"
    assert len(disk.exists_calls[0]) == 2 * 4
    sched.allocated("a", list(range(10, 15)), 128)
    assert sched.build([]).store_loads == {"a": [(*words(sched, a)[0], 10)]}
    # No host tier: the puts take vLLM's blocks, to the store where it lacked them (block 2
    # it holds for both ranks).
    moves = sched.build([Scheduled("a", 128, 472, list(range(10, 15)), True)])
    assert not moves.saves
    assert [(host, block) for host, block, *_ in moves.puts] == [(False, 11), (False, 13)]


def test_the_host_then_the_store() -> None:
    disk = FakeStore("DISK")
    sched = make(stores=[disk])
    a = list(range(130))
    (_, row), = prefill(sched, "a", a, [1, 2]).saves
    sched.finished("a")
    b = a[:128] + list(range(900, 1072))
    disk.data[keys(sched, b)[1]] = b""
    assert sched.lookup("b", b, 0) == (256, True)
    sched.allocated("b", [20, 21, 22], 256)
    assert sched.hit_tokens("b") == {HOST: 128, "DISK": 128}
    moves = sched.build([])
    assert moves.host_loads == [(row, 20)]
    assert moves.store_loads == {"b": [(*words(sched, b)[1], 21)]}


def test_a_whole_block_in_the_store_beats_the_hosts_piece_of_it() -> None:
    disk = FakeStore("DISK")
    sched = make(hash_block_size=16, stores=[disk])
    a = list(range(300))
    host = [row for _, row in prefill(sched, "a", a, [1, 2, 3]).saves]
    sched.finished("a")
    b = a[:176] + list(range(5000, 5124))  # the host has 176 of its tokens
    disk.data[keys(sched, b)[1]] = b""  # another engine put its block 1 whole
    assert sched.lookup("b", b, 0) == (256, True)
    sched.allocated("b", [20, 21, 22], 256)
    assert sched.hit_tokens("b") == {HOST: 128, "DISK": 128}
    moves = sched.build([])
    assert moves.host_loads == [(host[0], 20)], "not the copy of a's block 1"
    assert moves.store_loads == {"b": [(*words(sched, b)[1], 21)]}


def test_a_store_the_workers_say_stopped_gets_no_more_puts() -> None:
    """A disk gone full or read-only: once a worker says so, the scheduler plans no writes
    to it (the others still get theirs), and its loads go on."""
    disk, mooncake = FakeStore("DISK"), FakeStore("MOONCAKE")
    sched = make(stores=[disk, mooncake])
    moves = prefill(sched, "a", list(range(400)), [1, 2, 3, 4])
    assert {names for *_, names in moves.puts} == {("DISK", "MOONCAKE")}
    sched.stop_saving({"DISK"})
    b = list(range(1000, 1400))
    moves = prefill(sched, "b", b, [5, 6, 7, 8])
    assert [names for *_, names in moves.puts] == [("MOONCAKE",)] * 3
    disk.data.update(dict.fromkeys(keys(sched, b)[:2], b"x"))
    assert make(stores=[disk, mooncake]).lookup("c", b, 0) == (256, True), "loads go on"


def test_hit_tokens_count_what_loads_served_not_what_they_planned() -> None:
    """A disk load of three blocks whose second fails: vLLM recomputes from it on, so the
    connector counts the first block's 128 tokens served, not 384; the request's hits by
    tier say the same. Host hits alone count when planned (their copies do not fail)."""
    disk = FakeStore("DISK")
    a = list(range(520))
    sched = make(stores=[disk])
    disk.data.update(dict.fromkeys(keys(sched, a)[:3], b"x"))
    assert sched.lookup("a", a, 0) == (384, True)
    sched.allocated("a", [1, 2, 3, 4, 5], 384)
    assert sched.take_counters().get("hit_tokens", 0) == 0, "not served yet"
    sched.loads_ended({"a"}, {2})
    assert sched.take_counters()["hit_tokens"] == 128
    assert sched.hit_tokens("a") == {"DISK": 128}
    # A load that lands whole counts whole.
    other = make(stores=[disk])
    assert other.lookup("b", a, 0) == (384, True)
    other.allocated("b", [6, 7, 8, 9, 10], 384)
    other.loads_ended({"b"}, ())
    assert other.take_counters()["hit_tokens"] == 384
    assert other.hit_tokens("b") == {"DISK": 384}


def test_a_producer_saves_and_never_loads_a_consumer_loads_and_never_saves() -> None:
    """vLLM's kv_role: a prefill server (kv_producer) puts what it computes and is served
    nothing; a decode server (kv_consumer) is served and puts nothing."""
    store = FakeStore("MOONCAKE")
    a = list(range(400))
    producer = TierScheduler(block_size=128, hash_block_size=128, num_host_blocks=0,
                             eviction_policy="lru", stores=[store], identities=[ID],
                             loads=False)
    moves = prefill(producer, "a", a, [1, 2, 3, 4])
    assert [names for *_, names in moves.puts] == [("MOONCAKE",)] * 3
    store.data.update(dict.fromkeys(keys(producer, a), b"x"))
    assert producer.lookup("again", a, 0) == (0, False), "a producer loads nothing"
    consumer = TierScheduler(block_size=128, hash_block_size=128, num_host_blocks=8,
                             eviction_policy="lru", stores=[store], identities=[ID],
                             saves=False)
    assert consumer.lookup("b", a, 0) == (384, True)
    consumer.allocated("b", [5, 6, 7, 8], 384)
    moves = consumer.build([Scheduled("b", 384, 16, [5, 6, 7, 8], True)])
    assert not moves.saves and not moves.puts, "a consumer saves nothing"
    fresh = list(range(2000, 2400))
    moves = prefill(consumer, "c", fresh, [9, 10, 11, 12])
    assert not moves.saves and not moves.puts


@pytest.mark.parametrize("held_by, bound, now", [
    ("DISK", 2, True), ("DISK", 1, False), ("MOONCAKE", 2, False)])
def test_a_small_load_from_the_disk_runs_before_the_forward(held_by: str, bound: int,
                                                             now: bool) -> None:
    """A request whose load is all from the disk and at most ``sync_disk_blocks`` blocks is
    not asynchronous: vLLM schedules it at once, and its blocks are read before that step's
    forward (``disk_loads``); a longer load, or one from the store, stays asynchronous. Its
    tokens count served once the workers say the load ran, less a block that failed."""
    disk, mooncake = FakeStore("DISK"), FakeStore("MOONCAKE")
    sched = make(num_host_blocks=0, stores=[disk, mooncake], sync_disk_blocks=bound)
    a = list(range(400))
    store = disk if held_by == "DISK" else mooncake
    store.data.update(dict.fromkeys(keys(sched, a)[:2], b""))
    assert sched.lookup("a", a, 0) == (256, not now)
    sched.allocated("a", [20, 21, 22, 23], 256)
    moves = sched.build([Scheduled("a", 256, 144, [20, 21, 22, 23], True)])
    loads = {"a": [(*words(sched, a)[0], 20), (*words(sched, a)[1], 21)]}
    assert (moves.disk_loads, moves.store_loads) == ((loads, {}) if now else ({}, loads))
    assert sched.hit_tokens("a") == {held_by: 256}
    sched.loads_ended({"a"}, {21})  # the second block failed: vLLM recomputes it
    assert sched.take_counters().get("hit_tokens") == 128
    assert sched.hit_tokens("a") == {held_by: 128}

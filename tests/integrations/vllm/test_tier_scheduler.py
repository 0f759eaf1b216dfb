"""``TierScheduler`` against the calls vLLM makes, in vLLM's order: ``lookup``
(get_num_new_matched_tokens), ``allocated`` (update_state_after_alloc), ``build`` with the rows
of the step's scheduler output (build_connector_meta), ``finished`` (request_finished)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from atb_mem.integrations.vllm.scheduler import HOST, Scheduled, TierMoves, TierScheduler
from atb_mem.kv.tiers.store import block_key
from tests.integrations.vllm.fakes import FakeStore

ID = "m-tp0"


def make(num_host_blocks: int = 8, block_size: int = 128, hash_block_size: int = 128,
         stores: Sequence[FakeStore] = (), identities: Sequence[str] = (ID,),
         sync_disk_blocks: int = 0) -> TierScheduler:
    return TierScheduler(block_size=block_size, hash_block_size=hash_block_size,
                         num_host_blocks=num_host_blocks, eviction_policy="lru",
                         stores=list(stores), identities=list(identities),
                         sync_disk_blocks=sync_disk_blocks)


def words(sched: TierScheduler, tokens: Sequence[int]) -> list[tuple[int, int]]:
    return [(int(w[0]), int(w[1])) for w in sched.index.block_hashes(list(tokens))]


def keys(sched: TierScheduler, tokens: Sequence[int], identity: str = ID) -> list[str]:
    return [block_key(identity, w) for w in sched.index.block_hashes(list(tokens))]


def prefill(sched: TierScheduler, req_id: str, tokens: list[int], blocks: list[int],
            num_computed: int = 0) -> TierMoves:
    """A request vLLM admits and prefills whole in one step."""
    external, _ = sched.lookup(req_id, tokens, num_computed)
    sched.allocated(req_id, blocks, external)
    done = num_computed + external
    return sched.build([Scheduled(req_id, done, len(tokens) - done, blocks, True)])


def test_a_repeated_prompt_is_served_from_the_host() -> None:
    sched = make()
    full = sched.index.num_free_blocks
    a = list(range(1000, 1300))
    assert sched.lookup("a", a, 0) == (0, False)
    sched.allocated("a", [10, 11, 12], 0)
    assert sched.hit_tokens("a") == {}
    moves = sched.build([Scheduled("a", 0, 300, [10, 11, 12], True)])
    assert not (moves.host_copies or moves.host_loads or moves.store_loads or moves.puts)
    assert [block for block, _ in moves.saves] == [10, 11]  # the partial block 2 is not
    host = [row for _, row in moves.saves]
    assert len(set(host)) == 2 and 0 not in host
    a.append(7)  # vLLM sampled a token: a decode step completes no block
    assert not sched.build([Scheduled("a", 300, 1)])
    assert sched.finished("a") is False
    assert sched.num_requests == 0 and sched.index.num_free_blocks == full

    b = list(range(1000, 1300))
    assert sched.lookup("b", b, 0) == (256, False)
    sched.allocated("b", [20, 21, 22], 256)
    assert sched.hit_tokens("b") == {HOST: 256}
    moves = sched.build([Scheduled("b", 256, 44, [20, 21, 22], True)])
    assert moves.host_loads == [(host[0], 20), (host[1], 21)]
    assert not (moves.saves or moves.host_copies or moves.store_loads)
    # vLLM's own cache had block 0: only block 1 comes from the host.
    assert sched.lookup("c", list(b), 128) == (128, False)
    sched.allocated("c", [30, 31, 32], 128)
    assert sched.build([]).host_loads == [(host[1], 31)]
    assert sched.take_counters() == {"lookups": 3, "hit_tokens": 384}
    assert sched.take_counters() == {}
    for req_id in ("b", "c"):
        assert sched.finished(req_id) is False
    assert sched.num_requests == 0 and sched.index.num_free_blocks == full


def test_a_salt_keeps_prompts_apart() -> None:
    sched = make()
    prompt = list(range(300))
    sched.lookup("a", prompt, 0, salt="lora\0x")
    sched.allocated("a", [1, 2, 3], 0)
    assert len(sched.build([Scheduled("a", 0, 300, [1, 2, 3], True)]).saves) == 2
    sched.finished("a")
    assert sched.lookup("b", list(prompt), 0) == (0, False)
    assert sched.lookup("c", list(prompt), 0, salt="lora\0x") == (256, False)


def test_a_shared_prefix_ending_inside_a_block_is_copied_and_loaded() -> None:
    sched = make(hash_block_size=16)
    a = list(range(300))
    host = [row for _, row in prefill(sched, "a", a, [1, 2, 3]).saves]
    sched.finished("a")
    b = a[:176] + list(range(5000, 5084))  # 128 + 3 * 16 tokens shared, 260 in all
    assert sched.lookup("b", b, 0) == (176, False)
    sched.allocated("b", [20, 21, 22], 176)
    assert sched.hit_tokens("b") == {HOST: 176}
    moves = sched.build([Scheduled("b", 176, 84, [20, 21, 22], True)])
    (source, own), = moves.host_copies
    assert source == host[1] and own not in (0, *host)
    assert moves.host_loads == [(host[0], 20), (own, 21)]  # after the copy
    assert moves.saves == [(21, own)], "the completed block replaces the copy's bytes"
    sched.finished("b")
    # What b computed is now whole in the host.
    assert sched.lookup("c", list(b), 0) == (256, False)
    sched.allocated("c", [30, 31, 32], 256)
    moves = sched.build([Scheduled("c", 256, 4, [30, 31, 32], True)])
    assert moves.host_loads == [(host[0], 30), (own, 31)] and not moves.host_copies
    # With vLLM's own cache holding block 0, only the partial block is loaded.
    d = a[:176] + list(range(7000, 7100))
    assert sched.lookup("d", d, 128) == (48, False)
    sched.allocated("d", [40, 41, 42], 48)
    moves = sched.build([])
    (source, own_d), = moves.host_copies
    assert source in (host[1], own), "either block holds those 48 tokens"
    assert own_d not in (0, *host, own) and moves.host_loads == [(own_d, 41)]
    assert sched.hit_tokens("d") == {HOST: 48}


def test_a_lookup_repeated_for_a_request_not_scheduled_pins_nothing_more() -> None:
    sched = make(hash_block_size=16)
    full = sched.index.num_free_blocks
    a = list(range(300))
    prefill(sched, "a", a, [1, 2, 3])
    sched.finished("a")
    b = a[:176] + list(range(5000, 5084))
    assert sched.lookup("b", b, 0) == (176, False)
    after_one = sched.index.num_free_blocks
    assert after_one == full - 3  # the hit, the copy's block, the last block
    assert len(sched.build([]).host_copies) == 1
    for _ in range(5):  # vLLM could not allocate for it: every step asks again
        assert sched.lookup("b", b, 0) == (176, False)
        # The same answer, its blocks still pinned: the copy is not made again.
        assert not sched.build([]).host_copies
        assert sched.index.num_free_blocks == after_one and len(sched.index) == 1
    assert sched.counters["lookups"] == 2  # "a" and "b", once each
    sched.build([])
    assert sched.finished("b") is False  # aborted while waiting
    assert sched.num_requests == 0 and sched.index.num_free_blocks == full
    assert len(sched.index) == 0


def test_decode_blocks_are_saved_as_they_fill() -> None:
    sched = make()
    a = list(range(200))
    moves = prefill(sched, "a", a, [10, 11])
    assert [block for block, _ in moves.saves] == [10]
    saved = []
    new_block: list[int] | None
    while len(a) < 390:
        a.append(len(a) % 50)  # the token sampled last step, computed in this one
        new_block = [10 + len(a) // 128] if len(a) % 128 == 1 else None
        moves = sched.build([Scheduled("a", len(a) - 1, 1, new_block)])
        if moves.saves:
            saved.append((len(a), moves.saves))
    assert [length for length, _ in saved] == [256, 384]
    assert [save[0][0] for _, save in saved] == [11, 12]
    rows = [save[0][1] for _, save in saved]
    sched.finished("a")
    assert sched.lookup("b", list(a[:390]), 0) == (384, False)
    sched.allocated("b", [20, 21, 22, 23], 384)
    assert [row for row, _ in sched.build([]).host_loads][1:] == rows


def test_a_step_of_draft_tokens_saves_only_the_tokens_the_request_has() -> None:
    sched = make()
    a = list(range(250))
    prefill(sched, "a", a, [10, 11])
    a.append(1)  # 251 tokens; the step also checks 8 draft tokens past them
    assert not sched.build([Scheduled("a", 250, 9)]).saves
    a.extend(range(5))  # 256 accepted
    assert [block for block, _ in sched.build([Scheduled("a", 255, 9)]).saves] == [11]


def test_a_preempted_request_comes_back_from_the_host() -> None:
    sched = make()
    full = sched.index.num_free_blocks
    a = list(range(200))
    prefill(sched, "a", a, [10, 11])
    while len(a) < 260:
        a.append(3)
        new_block = [12] if len(a) == 257 else None
        sched.build([Scheduled("a", len(a) - 1, 1, new_block)])
    # vLLM preempted it (freeing blocks 10-12) and asks again, with its outputs.
    assert not sched.build([])
    assert sched.lookup("a", a, 0) == (256, False)
    assert len(sched.index) == 1
    sched.allocated("a", [30, 31, 32], 256)
    moves = sched.build([Scheduled("a", 256, 4, [30, 31, 32], resumed=True)])
    assert [block for _, block in moves.host_loads] == [30, 31] and not moves.saves
    while len(a) < 384:
        a.append(4)
        new_block = [33] if len(a) == 385 else None
        moves = sched.build([Scheduled("a", len(a) - 1, 1, new_block)])
    assert [block for block, _ in moves.saves] == [32], "the resumed blocks are saved"
    assert sched.finished("a") is False
    assert sched.index.num_free_blocks == full and len(sched.index) == 0


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


def test_a_full_index_serves_and_saves_nothing_and_does_not_fail() -> None:
    disk = FakeStore("DISK")
    sched = make(num_host_blocks=3, stores=[disk])
    prefill(sched, "a", list(range(300)), [1, 2, 3])  # pins all three host blocks
    b = list(range(1000, 1300))
    assert sched.lookup("b", b, 0) == (0, False)  # OutOfMemoryError in the index
    assert sched.counters["host_full"] == 1
    sched.allocated("b", [10, 11, 12], 0)
    moves = sched.build([Scheduled("b", 0, 300, [10, 11, 12], True)])
    assert not moves.saves
    assert [(host, block, names) for host, block, _, _, names in moves.puts] == \
        [(False, 10, ("DISK",)), (False, 11, ("DISK",))]
    assert sched.finished("b") is False and sched.num_requests == 1
    assert sched.finished("a") is False and sched.num_requests == 0
    assert sched.lookup("b", b, 0) == (0, False) and sched.counters["host_full"] == 1


def test_a_prompt_longer_than_the_host_tier_is_not_an_error() -> None:
    disk = FakeStore("DISK")
    sched = make(num_host_blocks=2, stores=[disk])
    a = list(range(300))  # three blocks' worth: the index raised ValueError for it
    assert sched.lookup("a", a, 0) == (0, False)
    assert sched.counters["host_full"] == 1
    sched.allocated("a", [10, 11, 12], 0)
    moves = sched.build([Scheduled("a", 0, 300, [10, 11, 12], True)])
    assert not moves.saves and [block for _, block, *_ in moves.puts] == [10, 11]
    assert sched.finished("a") is False


def test_a_decode_longer_than_the_host_tier_is_not_an_error() -> None:
    sched = make(num_host_blocks=3)
    a = list(range(200))
    prefill(sched, "a", a, [10, 11])
    saved = []
    while len(a) < 520:
        a.append(1)
        new_block = [10 + len(a) // 128] if len(a) % 128 == 1 else None
        moves = sched.build([Scheduled("a", len(a) - 1, 1, new_block)])
        saved += [block for block, _ in moves.saves]
    assert saved == [11, 12], "block 3 would be the tier's fourth"
    assert sched.counters["host_full"] == 1
    sched.finished("a")
    assert sched.lookup("b", a[:384], 0) == (256, False), "what it saved stays"


def test_a_decode_that_outgrows_a_full_index_stops_saving_to_the_host() -> None:
    disk = FakeStore("DISK")
    sched = make(num_host_blocks=3, stores=[disk])
    a, b = list(range(200)), list(range(5000, 5100))
    prefill(sched, "a", a, [10, 11])
    prefill(sched, "b", b, [20])  # every host block is now pinned
    while len(a) < 384:
        a.append(1)
        moves = sched.build([Scheduled("a", len(a) - 1, 1, [12] if len(a) == 257 else None)])
        if len(a) == 256:
            assert [block for block, _ in moves.saves] == [11]
    assert sched.counters["host_full"] == 1
    assert not moves.saves, "no host block for block 2"
    assert [(host, block) for host, block, *_ in moves.puts] == [(False, 12)]
    for req_id in ("a", "b"):
        assert sched.finished(req_id) is False
    assert sched.lookup("c", list(a), 0)[0] == 256, "what it saved stays"


def test_finished_never_holds_vllms_blocks_and_forgets_the_request() -> None:
    sched = make()
    assert sched.finished("never-seen") is False
    sched.lookup("a", list(range(300)), 0)
    assert sched.num_requests == 1
    assert sched.finished("a") is False and sched.num_requests == 0
    assert sched.hit_tokens("a") == {}
    assert sched.finished("a") is False
    sched.allocated("a", [1, 2, 3], 0)  # a late call for a finished request is ignored
    assert not sched.build([Scheduled("a", 0, 300, [1, 2, 3], True)])


@pytest.mark.parametrize("hash_block_size, expected", [(128, 128), (16, 240)])
def test_the_last_token_is_never_served(hash_block_size: int, expected: int) -> None:
    sched = make(hash_block_size=hash_block_size)
    prefill(sched, "a", list(range(256)), [1, 2])
    sched.finished("a")
    assert sched.lookup("b", list(range(256)), 0) == (expected, False)


def test_no_host_tier_and_no_store_plans_nothing() -> None:
    sched = make(num_host_blocks=0)
    assert sched.lookup("a", list(range(300)), 0) == (0, False)
    sched.allocated("a", [1, 2, 3], 0)
    assert not sched.build([Scheduled("a", 0, 300, [1, 2, 3], True)])
    assert sched.lookup("b", [], 0) == (0, False)


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
    tier say the same. Host hits count when planned (their copies do not fail)."""
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


def test_a_decodes_new_blocks_are_hashed_on_from_the_last_not_from_the_start() -> None:
    """Each block a decode fills is hashed from the one before it (a chained-hash call in
    the core), not by hashing the whole context again; the keys are the same."""
    store = FakeStore("MOONCAKE")
    sched = make(stores=[store], block_size=16, hash_block_size=16)
    tokens = list(range(40))
    prefill(sched, "a", tokens, [1, 2, 3])
    reference = make(block_size=16, hash_block_size=16)  # its index hashes the whole chain
    hashed: list[int] = []

    class Counting:
        """The index, counting the tokens each block_hashes call hashes."""

        def __init__(self, index: object) -> None:
            self.index = index

        def __getattr__(self, name: str) -> object:
            return getattr(self.index, name)

        def block_hashes(self, token_ids: Sequence[int], **kwargs: object) -> object:
            hashed.append(len(token_ids))
            return self.index.block_hashes(token_ids, **kwargs)  # type: ignore[attr-defined]

    sched.index = Counting(sched.index)  # type: ignore[assignment]
    puts = 0
    for step in range(30):  # a decode of 30 tokens fills blocks 2 and 3
        tokens.append(1000 + step)
        moves = sched.build([Scheduled("a", len(tokens) - 1, 1, [4] if step == 7 else [])])
        if moves.puts:
            puts += 1
            assert [(h, lo) for *_, h, lo, _ in moves.puts] == \
                words(reference, tokens)[len(tokens) // 16 - 1:len(tokens) // 16]
    assert puts == 2 and hashed == [16, 16], "one new block at a time"


def test_hashes_chained_from_a_parent_equal_the_whole_chain() -> None:
    index = make(block_size=16, hash_block_size=16).index
    tokens = list(range(100))
    for salt in (None, "s"):
        whole = index.block_hashes(tokens, cache_salt=salt)
        head = index.block_hashes(tokens[:32], cache_salt=salt)
        tail = index.block_hashes(tokens[32:], parent=[int(w) for w in head[-1]])
        assert (np.concatenate([head, tail]) == whole).all()
    with pytest.raises(ValueError, match="cache_salt or parent"):
        index.block_hashes(tokens, cache_salt="s", parent=[1, 2])
    with pytest.raises((TypeError, ValueError)):
        index.block_hashes(tokens, parent=[1])


def test_a_host_tier_too_full_for_the_whole_prompt_still_serves_its_hit() -> None:
    """Seven host blocks, four pinned by a running request: a prompt of six blocks whose
    first two the host holds cannot take the whole prompt, but is served those two (it used
    to get no host hit at all); what it computes beyond is not saved to the host."""
    sched = make(num_host_blocks=7)
    x = list(range(400))
    prefill(sched, "x", x, [1, 2, 3, 4])
    sched.finished("x")  # three blocks cached, unpinned
    prefill(sched, "y", list(range(5000, 5400)), [5, 6, 7, 8])  # running: pins four
    z = x[:256] + list(range(9000, 9500))
    assert sched.lookup("z", z, 0) == (256, False)
    assert sched.counters["host_full"] == 1
    sched.allocated("z", [10, 11, 12, 13, 14, 15], 256)
    moves = sched.build([Scheduled("z", 256, len(z) - 256, [10, 11, 12, 13, 14, 15], True)])
    assert [block for _, block in moves.host_loads] == [10, 11]
    assert not moves.saves
    assert sched.hit_tokens("z") == {HOST: 256}


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

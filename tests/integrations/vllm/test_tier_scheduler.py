"""``TierScheduler`` against the calls vLLM makes, in vLLM's order: ``lookup``
(get_num_new_matched_tokens), ``allocated`` (update_state_after_alloc), ``build`` with the rows
of the step's scheduler output (build_connector_meta), ``finished`` (request_finished): the
host tier (the disk and the store: ``test_tier_scheduler_stores.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from atb_mem.integrations.vllm.scheduler import HOST, Scheduled
from tests.integrations.vllm.fakes import FakeStore
from tests.integrations.vllm.scheduler_calls import keys, make, prefill, words


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


def test_an_ended_requests_last_pieces_are_saved_and_hit() -> None:
    """A request that ends with 300 tokens computed (two full blocks and 44 tokens): the 44
    tokens' two whole pieces of 16 are copied into the host first thing next step (vLLM
    holds the block until then) and hit a later prompt sharing them (a copy of the block,
    then its load); without the count of computed tokens nothing of the tail is saved."""
    for computed, hit in ((300, 256 + 32), (None, 256)):
        sched = make(hash_block_size=16)
        a = list(range(2000, 2300))
        prefill(sched, "a", a, [5, 6, 7])
        assert sched.finished("a", computed) is (computed is not None)
        moves = sched.build([])
        if computed is None:
            assert not moves.tail_saves
        else:
            (req_id, block, row), = moves.tail_saves
            assert (req_id, block) == ("a", 7) and row != 0 and not moves.saves
        b = a[:296] + list(range(9000, 9100))
        assert sched.lookup("b", b, 0) == (hit, False)
        sched.allocated("b", [1, 2, 3, 4], hit)
        moves = sched.build([])
        assert [target for _, target in moves.host_loads] == [1, 2, 3][:-(-hit // 128)]
        if computed is not None:  # the tail's block, copied whole into b's own host block
            (src, _), = moves.host_copies
            assert src == row


def test_no_tail_is_saved_while_a_load_is_in_flight_or_past_a_gap() -> None:
    disk = FakeStore("DISK")
    sched = make(hash_block_size=16, stores=[disk])
    a = list(range(3000, 3300))
    disk.data.update(dict.fromkeys(keys(sched, a)[:2], b""))
    assert sched.lookup("a", a, 0) == (256, True)
    sched.allocated("a", [5, 6, 7], 256)
    sched.finished("a", 300)  # aborted while its load ran: its blocks' bytes are not known
    assert not sched.build([]).tail_saves
    sched = make(hash_block_size=16)
    sched.lookup("c", a, 0)
    sched.allocated("c", [5, 6, 7], 0)
    sched.build([Scheduled("c", 0, 128, [5, 6, 7], True)])  # one block computed, one saved
    sched.finished("c", 300)  # block 1 never saved: a tail past it would leave a hole
    assert not sched.build([]).tail_saves

"""What the tiers keep and what they offer: vLLM's request priority as the host tier's
retention (the ``priority`` eviction policy), vLLM's cache reset, a block whose load failed,
and the disk's sightings."""

from __future__ import annotations

import pytest

from atb_mem.integrations.vllm.scheduler import Scheduled, TierScheduler
from atb_mem.kv.tiers.store import block_key
from tests.integrations.vllm.fakes import FakeStore
from tests.integrations.vllm.vllm_process import token_prompt


def _saved(sched: TierScheduler, req_id: str, tokens: list[int], priority: int) -> None:
    """A request prefilled whole, its two full blocks saved, then finished."""
    external, _ = sched.lookup(req_id, tokens, 0, priority=priority)
    sched.allocated(req_id, [1, 2, 3], external)
    sched.build([Scheduled(req_id, external, len(tokens) - external, [1, 2, 3], True)])
    sched.finished(req_id)


@pytest.mark.parametrize(("policy", "kept"), [("priority", "urgent"), ("lru", "recent")])
def test_an_urgent_requests_blocks_outlive_more_recent_ones(policy: str, kept: str) -> None:
    # Five host blocks: two requests leave two cached blocks each; a third needs three.
    sched = TierScheduler(block_size=128, hash_block_size=128, num_host_blocks=5,
                          eviction_policy=policy, stores=[], identities=["m-tp0"])
    urgent, recent, third = token_prompt(10, 300), token_prompt(11, 300), token_prompt(12, 300)
    _saved(sched, "urgent", urgent, priority=-50)  # vLLM runs lower priorities first
    _saved(sched, "recent", recent, priority=0)
    _saved(sched, "third", third, priority=0)
    prompts = {"urgent": urgent, "recent": recent}
    evicted = "recent" if kept == "urgent" else "urgent"
    assert sched.lookup(kept, prompts[kept], 0)[0] == 256  # first: a miss would evict
    assert sched.lookup(evicted, prompts[evicted], 0)[0] == 0


def test_after_a_reset_nothing_cached_before_is_served_by_any_tier() -> None:
    """vLLM's reset_prefix_cache(reset_external=True), after new weights."""
    store = FakeStore()
    sched = TierScheduler(block_size=128, hash_block_size=16, num_host_blocks=8,
                          eviction_policy="priority", stores=[store], identities=["m-tp0"])
    prompt = token_prompt(13, 300)
    _saved(sched, "first", prompt, priority=0)
    # ... and the store holds its blocks too, as the workers' puts would have left them.
    store.data = {block_key("m-tp0", words): b"" for words in sched.index.block_hashes(prompt)}
    assert sched.lookup("again", prompt, 0)[0] == 256
    sched.finished("again")
    sched.reset()
    assert sched.lookup("after", prompt, 0) == (0, False)


def test_a_block_whose_load_failed_is_not_offered_again_at_once() -> None:
    """vLLM looks a request whose load failed up again in the same pass: offered the same
    block, it would fail again, for ever (a file only another process can read, a store
    slower than the timeout)."""
    store = FakeStore()
    sched = TierScheduler(block_size=128, hash_block_size=128, num_host_blocks=0,
                          eviction_policy="priority", stores=[store], identities=["m-tp0"])
    prompt = token_prompt(14, 300)
    hashes = [(int(high), int(low)) for high, low in sched.index.block_hashes(prompt)]
    store.data = {block_key("m-tp0", words): b"" for words in hashes}
    assert sched.lookup("r", prompt, 0) == (256, True)
    sched.allocated("r", [5, 6, 7], 256)
    assert sched.build([]).store_loads == {"r": [(*hashes[0], 5), (*hashes[1], 6)]}
    sched.loads_ended({"r"}, {6})  # the second block failed: vLLM recomputes from it
    assert sched.lookup("r", prompt, 0) == (128, True)
    other = TierScheduler(block_size=128, hash_block_size=128, num_host_blocks=0,
                          eviction_policy="priority", stores=[store], identities=["m-tp0"])
    assert other.lookup("r", prompt, 0) == (256, True), "the store still says it holds both"


def test_the_disk_is_given_a_block_on_its_second_sighting_only() -> None:
    """The disk writes what is seen twice (KVBM's rule): the scheduler side counts, so no
    worker copies a block for the disk to refuse. A hit is a sighting too."""
    disk, store = FakeStore("DISK"), FakeStore("MOONCAKE")
    sched = TierScheduler(block_size=128, hash_block_size=128, num_host_blocks=8,
                          eviction_policy="priority", stores=[disk, store],
                          identities=["m-tp0"], disk_min_seen=2)
    prompt = token_prompt(15, 300)

    def puts(req_id: str) -> list[tuple[str, ...]]:
        external, _ = sched.lookup(req_id, prompt, 0)
        sched.allocated(req_id, [1, 2, 3], external)
        moves = sched.build([Scheduled(req_id, external, 300 - external, [1, 2, 3], True)])
        sched.finished(req_id)
        return [names for *_, names in moves.puts]

    assert puts("first") == [("MOONCAKE",)] * 2  # computed: seen once
    # The workers wrote them to the store.
    store.data = {block_key("m-tp0", words): b"" for words in sched.index.block_hashes(prompt)}
    assert puts("second") == [("DISK",)] * 2  # hit on the host: seen twice

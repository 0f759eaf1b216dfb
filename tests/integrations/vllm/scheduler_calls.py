"""The calls vLLM makes on ``TierScheduler``, as the scheduler tests make them: a scheduler
over fake stores, a prompt's block hashes and store keys, a request admitted and prefilled
whole in one step."""

from __future__ import annotations

from collections.abc import Sequence

from atb_mem.integrations.vllm.scheduler import Scheduled, TierMoves, TierScheduler
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

"""atb-mem quickstart: the example in the README (tests/test_readme.py keeps them equal)."""

import numpy as np

import atb_mem

kv = atb_mem.KVCachePool(num_blocks=1024, block_size=16, num_layers=32,
                         num_kv_heads=8, head_dim=128, dtype="float16")

# Two requests that share a 64-token system prompt.
system = np.arange(64, dtype=np.int32)
first = np.concatenate([system, np.array([1000, 1001, 1002], dtype=np.int32)])
second = np.concatenate([system, np.array([2000, 2001], dtype=np.int32)])
assert kv.alloc_sequence(1, first) == 0           # nothing cached yet

# Prefill writes its K/V into these slots (slot = block * block_size + offset), then says
# so: only computed blocks join the prefix cache.
prefill_slots = kv.slot_mapping([1], starts=[0], ends=[67])
assert prefill_slots.dtype == np.int32 and len(prefill_slots) == 67
kv.mark_computed(1)
assert kv.alloc_sequence(2, second) == 64         # the prompt's 4 full blocks are reused
kv.mark_computed(2)                               # (after its 2-token prefill)

# Decode: one call per step appends a token to every running sequence.
batch = kv.batch_table(max_seqs=8, max_blocks_per_seq=64)
batch.add(1)
batch.add(2)
batch.append_tokens()
n = len(batch)
print(batch.block_tables[:n, :6])   # int32 [batch, max_blocks], padded with block 0
print(batch.context_lens[:n])       # [68 67]
print(batch.slot_mapping[:n])       # where this step's K/V go

# Parallel sampling: the fork shares every block; the first append copies the shared,
# partly filled last block (copy-on-write) and reports the copy for the backing to execute.
kv.fork(1, 3)
kv.append_tokens([3])
print(kv.take_pending_copies())     # int32 [[src_block, dst_block]]

for seq_id in (1, 2, 3):
    batch.remove(seq_id) if seq_id in batch else None
    kv.free_sequence(seq_id)
print(kv.stats()["prefix_cache_hit_rate"], kv.num_free_blocks)

# One region reserved up front serves the KV blocks and other buffers (acl-like malloc/free).
pool = atb_mem.MemPool(64 << 20, alignment=64)
workspace = pool.malloc(256 * 1024)                   # -> Allocation(.offset, .size, .ptr)
pool.view(workspace, "float16")[:4] = 1.0             # numpy view of its bytes, no copy
layer_cache = atb_mem.KVCachePool(num_blocks=64, block_size=16, num_layers=2,
                                  num_kv_heads=8, head_dim=128, pool=pool)
print(pool.memory_summary())
layer_cache.close()                                   # gives its region back
pool.free(workspace)
assert pool.stats()["allocated_bytes.current"] == 0

"""Tests of atb_mem.kv: KVCachePool and BatchTable, their bytes, attention, planning."""

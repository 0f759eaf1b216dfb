"""Tests of atb_mem.memory: MemPool, the acl names, the backings."""

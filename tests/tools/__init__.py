"""Tests of atb_mem.tools: the atb-mem command."""

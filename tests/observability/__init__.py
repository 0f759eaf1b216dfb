"""Tests of atb_mem.observability: the Prometheus collector."""

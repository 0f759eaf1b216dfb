"""Tests of atb_mem.scheduling: ContinuousBatchScheduler and DynamicBatchScheduler."""

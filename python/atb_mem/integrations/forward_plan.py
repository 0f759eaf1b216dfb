"""What a model runner reads of a step's ``StepPlan``, declared once: the warm-up steps the
compiled forward runs at start-up and the plans tensor-parallel workers receive are this
(the scheduler's own ``StepPlan`` reads the same names)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ForwardPlan", "warm_up_plans"]


@dataclass(frozen=True)
class ForwardPlan:
    """A step's rows (``query_lens``, ``seq_lens``, ``query_start_loc``), tokens
    (``input_ids``, ``positions``), where their K/V goes (``slot_mapping``, group by group)
    and is read from (``block_tables``), and which rows' logits are sampled."""

    query_lens: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    block_tables: np.ndarray

    @property
    def num_batched_tokens(self) -> int:
        return len(self.input_ids)

    @classmethod
    def warm_up(cls, tokens: int, num_groups: int) -> ForwardPlan:
        """A step that changes no cache: one row of ``tokens`` new tokens whose slots are all
        -1 (the kernel writes nothing there) and whose table names block 1 (the kernel reads
        whatever it holds; the logits are dropped)."""
        lengths = np.array([tokens], dtype=np.int32)
        return cls(query_lens=lengths, seq_lens=lengths,
                   query_start_loc=np.array([0, tokens], dtype=np.int32),
                   input_ids=np.zeros(tokens, dtype=np.int32),
                   positions=np.arange(tokens, dtype=np.int32),
                   slot_mapping=np.full(num_groups * tokens, -1, dtype=np.int32),
                   logits_indices=np.array([tokens - 1], dtype=np.int32),
                   block_tables=np.ones((num_groups, 1, tokens), dtype=np.int32))


def warm_up_plans(num_groups: int) -> list[ForwardPlan]:
    """A step of one token and one of two: the graphs every later step reuses."""
    return [ForwardPlan.warm_up(tokens, num_groups) for tokens in (1, 2)]

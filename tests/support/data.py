"""Paths of the test data (tests/data, with its README saying whence it comes)."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"

# The first 1,000 requests of the Azure LLM inference trace 2023, code service (CC-BY 4.0).
AZURE_CODE_TRACE = DATA / "azure_llm_code_2023.csv"

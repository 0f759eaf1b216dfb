"""A store for the connector's tests: a dict behind ``KVStore``'s calls, which records the
calls made to it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


class FakeStore:
    """``KVStore`` over a dict; ``exists_calls`` holds each batch asked about, ``puts`` each
    key written. ``get_delay_s`` slows every read (a store slower than the load timeout)."""

    medium = "store"

    def __init__(self, name: str = "DISK", get_delay_s: float = 0.0) -> None:
        self.name = name
        self.data: dict[str, Any] = {}
        self.exists_calls: list[list[str]] = []
        self.gets: list[str] = []
        self.puts: list[str] = []
        self.get_delay_s = get_delay_s
        self.closed = False

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.exists_calls.append(list(keys))
        return [key in self.data for key in keys]

    def get(self, key: str) -> Any:
        self.gets.append(key)
        if self.get_delay_s:
            time.sleep(self.get_delay_s)
        return self.data.get(key)

    def put(self, key: str, value: Any) -> bool:
        self.puts.append(key)
        self.data[key] = value
        return True

    def close(self) -> None:
        self.closed = True

"""A store shared across engines: Mooncake Store (``mooncake-transfer-engine``, or
``mooncake-transfer-engine-non-cuda`` whose TCP transport runs on a CPU-only machine), reached
by URL::

    mooncake://HOST:PORT[?metadata=http://HOST:8080/metadata&segment=256MiB&buffer=64MiB]

``HOST:PORT`` is ``mooncake_master``'s RPC address; ``metadata`` its HTTP metadata server
(default: port 8080 on the same host); ``segment`` the memory this engine lends the store
(every client lends some: a block lives in the segment of the client that put it);
``buffer`` the client's transfer buffer, which must hold one block (its allocator rounds a
block up to an eighth of its power of two: a 2,064-byte one takes 2,304 bytes), or every put
would fail; a smaller one is refused at start-up. A few blocks' worth lets loads and saves
run at once.

Mooncake answers failures with codes and empty values rather than exceptions, so every call
here returns None or False on any failure, and the caller recomputes. A master that is gone
makes each call take seconds, so after a failure the store counts as down for
``RETRY_AFTER_S``: calls answer "not held" at once, lookups on the engine's thread stall
nothing, and one log line says so. Setting up against a master that never answers would
hang, so it runs under a deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlparse

from atb_mem._sizes import parse_size

__all__ = ["MooncakeStore", "parse_mooncake_url"]

log = logging.getLogger("atb_mem.tiers")

SETUP_TIMEOUT_S = 30.0
RETRY_AFTER_S = 5.0
# Mooncake's codes for a store it cannot reach (RPC failed, transfer failed): only these,
# and exceptions, count the store down; a refusal (no space, say) does not.
UNREACHABLE = frozenset({-900, -800})


def buffer_bytes_for(value_bytes: int) -> int:
    """The bytes a value of ``value_bytes`` takes in a Mooncake client's buffer. Its
    OffsetAllocator rounds every allocation up to a size class with 3 mantissa bits (an
    eighth of the size's power of two), and a buffer holds a class only if it is as large."""
    if value_bytes < 8:
        return value_bytes
    step = 1 << (value_bytes.bit_length() - 4)
    return -(-value_bytes // step) * step


_OPTIONS = ("metadata", "segment", "buffer")


def parse_mooncake_url(url: str) -> dict[str, Any]:
    """``mooncake://HOST:PORT?...`` as the client's settings; ValueError when malformed (its
    message names the URL, not the setting that holds it: callers say which)."""
    parsed = urlparse(url)
    try:
        port = parsed.port  # raises for a port that is no number or beyond 65535
    except ValueError:
        port = None
    if parsed.scheme != "mooncake" or not parsed.hostname or not port:
        raise ValueError(f"{url!r} is not mooncake://HOST:PORT[?options] (a port of 1 to "
                         f"65535)")
    options = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"{url!r}: unknown option {unknown[0]!r}; the options are "
                         f"{', '.join(_OPTIONS)}")
    sizes = {}
    for option, default in (("segment", "256MiB"), ("buffer", "64MiB")):
        try:
            sizes[option] = parse_size(options.get(option, default))
        except ValueError as error:
            raise ValueError(f"{url!r}: option {option}: {error}") from None
    return {
        "master": f"{parsed.hostname}:{port}",
        "metadata": options.get("metadata", f"http://{parsed.hostname}:8080/metadata"),
        "host": parsed.hostname,
        **sizes,
    }


class MooncakeStore:
    """``KVStore`` over a Mooncake Store client."""

    name = "MOONCAKE"
    medium = "store"

    def __init__(self, url: str) -> None:
        try:
            settings = parse_mooncake_url(url)
        except ValueError as error:
            raise ValueError(f"kv_store {error}") from None
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as error:
            raise ValueError(f"kv_store {url!r} needs Mooncake: pip install "
                             f"mooncake-transfer-engine-non-cuda (and Debian's libibverbs1, "
                             f"librdmacm1, libnuma1): {error}") from None
        store = MooncakeDistributedStore()
        result: list[int] = []
        setup = threading.Thread(target=lambda: result.append(store.setup(
            settings["host"], settings["metadata"], settings["segment"], settings["buffer"],
            "tcp", "", settings["master"])), daemon=True)
        setup.start()
        setup.join(SETUP_TIMEOUT_S)
        if not result:
            raise ValueError(f"kv_store {url!r}: mooncake_master did not answer within "
                             f"{SETUP_TIMEOUT_S:.0f} s")
        if result[0] != 0:
            raise ValueError(f"kv_store {url!r}: Mooncake's setup failed with code {result[0]}")
        self.url = url
        self.buffer_bytes: int = settings["buffer"]
        self.errors = 0
        """Calls that failed (the store unreachable, or refusing)."""
        self._store = store
        self._down_until = 0.0

    def register_layout(self, identity: str, value_bytes: int) -> None:
        """Refuses a client buffer that cannot hold one value of ``value_bytes``."""
        needed = buffer_bytes_for(value_bytes)
        if self.buffer_bytes < needed:
            raise ValueError(f"kv_store {self.url!r}: its buffer of {self.buffer_bytes} bytes "
                             f"holds no block of {value_bytes} bytes, which takes {needed} "
                             f"bytes of Mooncake's client buffer: give buffer={needed} or more")

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, detail: object, unreachable: bool = True) -> None:
        self.errors += 1
        if not unreachable:
            return
        if self._up():
            log.warning("atb-mem: the shared store %s failed (%s): requests recompute; "
                        "retrying in %.0f s", what, detail, RETRY_AFTER_S)
        self._down_until = time.monotonic() + RETRY_AFTER_S

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys or not self._up():
            return [False] * len(keys)
        try:
            codes = self._store.batch_is_exist(list(keys))
        except Exception as error:  # any failure is a miss
            self._failed("lookup", error)
            return [False] * len(keys)
        if any(code < 0 for code in codes):
            self._failed("lookup", f"code {min(codes)}",
                         any(code in UNREACHABLE for code in codes))
        return [code == 1 for code in codes]

    def get(self, key: str) -> bytes | None:
        if not self._up():
            return None
        try:
            value = self._store.get(key)
        except Exception as error:  # any failure is a miss
            self._failed("get", error)
            return None
        return bytes(value) or None  # Mooncake answers b'' for a miss and on errors

    def put(self, key: str, value: bytes) -> bool:
        if not self._up():
            return False
        try:
            code = self._store.put(key, value)
        except Exception as error:
            self._failed("put", error)
            return False
        if code != 0:
            self._failed("put", f"code {code}", code in UNREACHABLE)
        return bool(code == 0)

    def discard(self, key: str) -> None:
        """Drops a block whose value turned out damaged, so a later save puts it anew."""
        if self._up():
            try:
                self._store.remove(key, True)
            except Exception as error:
                self._failed("remove", error)

    def healthy(self) -> bool:
        """Whether the master answers (0 from Mooncake's health check)."""
        try:
            return bool(self._store.health_check() == 0)
        except Exception:
            return False

    def close(self) -> None:
        try:
            self._store.close()
        except Exception:  # closing a client whose master died
            pass

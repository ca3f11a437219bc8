"""What each engine's radix cache holds, as a client can tell: :class:`CachedPrefixes`, with
which :class:`arbor.engines.client.SGLangClient` commits a multi-fork prompt once before its forks."""

from __future__ import annotations


class CachedPrefixes:
    """Token sequences each server's radix cache holds, as far as this client can tell: the
    prompts it committed and every prompt + output it got back since the server last
    flushed (a new ``weight_version`` in a reply, or a flush sent through this client).
    Wrong after an LRU eviction, and then forks merely prefill their prefix again."""

    LIMIT = 1 << 20  # sequences remembered per server before starting afresh

    def __init__(self) -> None:
        self._held: dict[str, set[int]] = {}
        self._version: dict[str, str] = {}

    def holds(self, url: str, ids: list[int]) -> bool:
        return hash(tuple(ids)) in self._held.get(url, ())

    def add(self, url: str, ids: list[int], weight_version: str | None = None) -> None:
        if weight_version is not None and self._version.get(url) != weight_version:
            self._held.pop(url, None)  # new weights: the server flushed its cache
            self._version[url] = weight_version
        held = self._held.setdefault(url, set())
        if len(held) >= self.LIMIT:
            held.clear()
        held.add(hash(tuple(ids)))

    def forget(self) -> None:
        self._held.clear()

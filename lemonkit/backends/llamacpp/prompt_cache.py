"""Prompts kept beyond the slots: a bounded host-RAM cache of sequence states (llama-server's ``--cache-ram``).

A slot holds one prompt's K/V; when a new prompt takes the slot and shares little with it, that K/V would be
dropped. With a RAM cache the batcher first copies the slot's sequence state (``llama_state_seq_get_data``: its
cells' K/V and positions) here with its tokens, and a later prompt sharing more with a cached state than with any
slot has it restored into its slot (``llama_state_seq_set_data``) and evaluates only the rest. A notebook that
alternates between two long contexts, or many users with one system prompt, reuses what was computed.

The restored cells are the saved bits, so an answer is the same as without the cache. Entries are evicted least
recently used first; a state larger than the whole cache is not kept; a state is held once (an entry whose tokens
a newer one extends is dropped, and one restored into a slot leaves the cache: the slot holds it now).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field

__all__ = ["CachedPrompt", "PromptCache", "common_prefix"]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class CachedPrompt:
    """One saved sequence: the tokens whose K/V it holds from position 0, and the state bytes."""

    tokens: list[int]
    state: ctypes.Array[ctypes.c_uint8] = field(repr=False)
    size: int
    used: float = field(default_factory=time.perf_counter)


class PromptCache:
    """At most ``limit`` bytes of saved sequence states (``limit < 0``: no bound). Used by the decode thread only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: list[CachedPrompt] = []

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self._entries)

    def best(self, tokens: list[int]) -> tuple[CachedPrompt | None, int]:
        """The entry sharing the longest prefix with ``tokens``, and how many tokens it shares."""
        found, shared = None, 0
        for entry in self._entries:
            n = common_prefix(entry.tokens, tokens)
            if n > shared:
                found, shared = entry, n
        return found, shared

    def holds(self, tokens: list[int]) -> bool:
        """Whether an entry already holds ``tokens`` (as its own or as a prefix of its own)."""
        return any(len(e.tokens) >= len(tokens) and e.tokens[: len(tokens)] == tokens for e in self._entries)

    def add(self, tokens: list[int], state: ctypes.Array[ctypes.c_uint8], size: int) -> None:
        """Keep a state, evicting the least recently used entries until it fits."""
        if 0 <= self.limit < size:
            return
        self._entries = [e for e in self._entries if e.tokens != tokens[: len(e.tokens)]]  # superseded
        if self.limit >= 0:
            self._entries.sort(key=lambda e: e.used)
            while self._entries and self.nbytes + size > self.limit:
                self._entries.pop(0)
        self._entries.append(CachedPrompt(list(tokens), state, size))

    def take(self, entry: CachedPrompt) -> None:
        """``entry`` was restored into a slot: the slot holds it now."""
        self._entries = [e for e in self._entries if e is not entry]

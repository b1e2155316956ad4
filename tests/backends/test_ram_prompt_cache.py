"""The RAM prompt cache's bookkeeping: its bound, least recently used eviction, one copy of each prompt."""

from __future__ import annotations

import ctypes

import pytest

from lemonkit.backends.llamacpp.prompt_cache import PromptCache, common_prefix
from lemonkit.errors import InvalidArgument
from lemonkit.formats.llamacpp_args import parse_llamacpp_args


def _state(size: int) -> ctypes.Array[ctypes.c_uint8]:
    return (ctypes.c_uint8 * size)()


def test_the_best_entry_shares_the_longest_prefix() -> None:
    cache = PromptCache(1000)
    cache.add([1, 2, 3, 4], _state(10), 10)
    cache.add([1, 2, 9], _state(10), 10)
    entry, shared = cache.best([1, 2, 3, 7])
    assert entry is not None and entry.tokens == [1, 2, 3, 4] and shared == 3
    assert cache.best([5, 6]) == (None, 0)
    cache.take(entry)
    assert len(cache) == 1 and cache.best([1, 2, 3, 7])[1] == 2


def test_the_bound_evicts_the_least_recently_used_and_refuses_what_cannot_fit() -> None:
    cache = PromptCache(25)
    for first in (1, 2, 3):
        cache.add([first, 0], _state(10), 10)
    assert len(cache) == 2 and cache.nbytes == 20 and cache.best([1, 0])[0] is None  # the oldest went
    cache.add([9] * 5, _state(30), 30)  # larger than the whole cache: not kept, nothing evicted for it
    assert len(cache) == 2
    unbounded = PromptCache(-1)
    for first in range(5):
        unbounded.add([first], _state(100), 100)
    assert len(unbounded) == 5


def test_a_prompt_is_held_once() -> None:
    cache = PromptCache(1000)
    cache.add([1, 2], _state(10), 10)
    cache.add([1, 2, 3], _state(15), 15)  # extends the first: the first is superseded
    assert len(cache) == 1 and cache.holds([1, 2]) and cache.holds([1, 2, 3]) and not cache.holds([1, 3])
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([], [1]) == 0


def test_the_flag_takes_mebibytes() -> None:
    assert parse_llamacpp_args("--cache-ram 512")["cache_ram"] == 512
    assert parse_llamacpp_args("-cram -1")["cache_ram"] == -1
    with pytest.raises(InvalidArgument):
        parse_llamacpp_args("--cache-ram -2")

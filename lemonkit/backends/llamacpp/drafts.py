"""Draft tokens for speculative decoding, from the sequence itself (llama-server's ``--spec-type ngram-simple``).

A sequence that copies (an edit of a given text, fields extracted from a document, a turn quoting an earlier one)
repeats runs of its own prompt and output. :class:`NgramDrafter` indexes every n-gram of the sequence with the
position that followed its latest occurrence; when the sequence's last ``n`` tokens were seen before, the tokens
that followed them then are the draft. The batcher decodes the draft with the sequence's next token in one step and
keeps the prefix its own sampler agrees with (:mod:`~lemonkit.backends.llamacpp.batch`), so a draft costs a wider
step and never changes the output.

The draft length adapts to what the sequence accepts: it doubles after a draft accepted whole, falls to one more
than the accepted part otherwise, and a sequence whose drafts keep failing waits longer and longer (up to
:data:`MAX_PAUSE` steps) before it drafts again, so one that rarely accepts stops paying for drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_PAUSE", "NgramDrafter", "SpecSettings"]

#: the longest wait, in steps, between two drafts of a sequence whose drafts keep failing
MAX_PAUSE = 32


@dataclass(frozen=True)
class SpecSettings:
    """How a model speculates (llama-server's flags): ``--spec-type``, ``--draft-max``, ``--draft-min``."""

    kind: str = "none"  # "none" or "ngram-simple"
    draft_max: int = 16
    draft_min: int = 0
    ngram: int = 3  # the length of the run looked up (llama-server's ``--spec-ngram-size-n``)

    @property
    def on(self) -> bool:
        return self.kind != "none"


class NgramDrafter:
    """One sequence's n-gram index and draft length."""

    def __init__(self, settings: SpecSettings) -> None:
        self.settings = settings
        self._tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest earlier occurrence
        self._indexed = 0  # n-grams ending before this position are indexed
        self._length = max(1, settings.draft_min)
        self._pause = 0  # steps to wait before the next draft
        self._misses = 0

    def reset(self, tokens: list[int]) -> None:
        """Start over on a new sequence: its prompt."""
        self._tokens, self._after, self._indexed = [], {}, 0
        self._length, self._pause, self._misses = max(1, self.settings.draft_min), 0, 0
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """The sequence grew by ``tokens`` (prompt chunks, accepted drafts, sampled tokens)."""
        self._tokens.extend(tokens)
        n, seq = self.settings.ngram, self._tokens
        # an n-gram is indexed once the token after it is known, so the sequence's own tail never finds itself
        for end in range(max(self._indexed, n), len(seq)):
            self._after[tuple(seq[end - n : end])] = end
        self._indexed = max(self._indexed, len(seq))

    def draft(self, room: int) -> list[int]:
        """Up to ``room`` tokens that followed the sequence's current tail the last time it occurred; none while
        paused, when the tail is new, or when fewer than ``--draft-min`` would be drafted."""
        if self._pause > 0:
            self._pause -= 1
            return []
        n = self.settings.ngram
        if len(self._tokens) < n:
            return []
        start = self._after.get(tuple(self._tokens[-n:]))
        if start is None:
            return []
        draft = self._tokens[start : start + min(room, self._length, self.settings.draft_max)]
        return draft if len(draft) >= max(1, self.settings.draft_min) else []

    def record(self, drafted: int, accepted: int) -> None:
        """Adapt to how much of a draft of ``drafted`` tokens the sampler accepted."""
        if accepted == drafted:
            self._length = min(self.settings.draft_max, self._length * 2)
            self._misses = 0
            return
        self._length = max(1, self.settings.draft_min, accepted + 1)
        if accepted == 0:
            self._misses += 1
            self._pause = min(MAX_PAUSE, 2 ** (self._misses - 1)) if self._misses > 1 else 0
        else:
            self._misses = 0

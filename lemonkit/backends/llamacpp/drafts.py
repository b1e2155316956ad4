"""Draft tokens for speculative decoding: from the sequence itself, from a pool the model's slots share, or from a
draft model (:mod:`~lemonkit.backends.llamacpp.draft_model`) or the target's own MTP head
(:mod:`~lemonkit.backends.llamacpp.mtp`), as llama-server's ``--spec-type`` values ``ngram-simple``, ``ngram-mod``,
``draft-simple`` and ``draft-mtp``.

A sequence that copies (an edit of a given text, fields extracted from a document, a turn quoting an earlier one)
repeats runs of its own prompt and output: ``ngram-simple`` (:class:`NgramIndex`) indexes every n-gram of the
sequence with the position that followed its latest occurrence, and drafts the tokens that followed the sequence's
tail then. ``ngram-mod`` (:class:`NgramPool`) keeps one table for all the model's sequences, an n-gram's hash to the
token that followed it last, and drafts by chained lookups: a ``lemonkit.map`` batch shares its template, so each
sequence drafts what the others wrote there. The batcher decodes a draft with the sequence's next token in one
step and keeps the prefix its own sampler agrees with (:mod:`~lemonkit.backends.llamacpp.batch`), so a draft costs
a wider step and never changes the output.

The draft length adapts to what the sequence accepts and to what steps cost on this machine (:func:`draft_length`):
a step drafts the length that yields the most tokens per second by the sequence's recent acceptance
(:class:`Acceptance`; a new sequence starts from the model's) and the measured times of decodes of each size
(:meth:`~lemonkit.backends.llamacpp.step_costs.StepCosts.curve`), none when no length pays: where two rows cost
twice one, a draft is worth nothing, where they cost 1.2 times, long ones are. A sequence whose drafts keep failing
also waits longer and longer (up to :data:`MAX_PAUSE` steps) before it drafts again (:class:`Pacer`).

Each kind drafts up to its own cap, as in llama-server: ``ngram-simple`` up to ``--spec-ngram-simple-size-m``,
``ngram-mod`` up to ``--spec-ngram-mod-n-max``, a draft model up to ``--spec-draft-n-max``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lemonkit.catalog.recipe_options import DEFAULT_DRAFT_MAX

__all__ = [
    "MAX_PAUSE",
    "Acceptance",
    "NgramIndex",
    "NgramPool",
    "Pacer",
    "SeqDrafts",
    "SpecSettings",
    "draft_length",
    "expected",
]

#: the longest wait, in steps, between two drafts of a sequence whose drafts keep failing
MAX_PAUSE = 32
#: how much of its weight a sequence's acceptance record keeps per drafted token tried: its last ten or so count
ACCEPTANCE_DECAY = 0.9


@dataclass(frozen=True)
class SpecSettings:
    """How a model speculates (llama-server's flags): ``--spec-type`` (tried in order), ``--spec-draft-n-max``,
    ``--spec-draft-n-min``, ``--spec-draft-p-min`` and the n-gram sizes."""

    kinds: tuple[str, ...] = ()  # of "ngram-simple", "ngram-mod", "draft-simple", "draft-mtp"; empty: none
    draft_max: int = DEFAULT_DRAFT_MAX  # a draft model's longest draft
    draft_min: int = 0
    #: a draft model stops drafting at a token it gives less than this probability (llama-server's default)
    p_min: float = 0.75
    ngram: int = 3  # the run ngram-simple looks up (``--spec-ngram-simple-size-n``)
    simple_max: int = 48  # and its longest draft (``--spec-ngram-simple-size-m``, llama-server's default)
    mod_match: int = 6  # the run ngram-mod keys its table on (``--spec-ngram-mod-n-match``)
    mod_min: int = 2  # ngram-mod's shortest draft (``--spec-ngram-mod-n-min``)
    mod_max: int = 64  # and its longest (``--spec-ngram-mod-n-max``)

    @property
    def on(self) -> bool:
        return bool(self.kinds)

    @property
    def wants_model(self) -> bool:
        return "draft-simple" in self.kinds

    @property
    def wants_mtp(self) -> bool:
        return "draft-mtp" in self.kinds

    def cap(self, kind: str) -> int:
        """The longest draft of ``kind``."""
        return {"ngram-simple": self.simple_max, "ngram-mod": self.mod_max}.get(kind, self.draft_max)

    @property
    def longest(self) -> int:
        """The longest draft of any kind in use."""
        return max((self.cap(kind) for kind in self.kinds), default=0)


class Acceptance:
    """How often drafted tokens were accepted, recent ones weighing most: the chance that a drafted token is
    accepted once the tokens before it were (each token up to the first rejected one is a trial)."""

    def __init__(self, prior: float = 0.5, weight: float = 2.0, decay: float = ACCEPTANCE_DECAY) -> None:
        self._decay = decay
        self._hits, self._tries = prior * weight, weight

    @property
    def rate(self) -> float:
        return self._hits / self._tries

    def record(self, drafted: int, accepted: int) -> None:
        trials = accepted + (accepted < drafted)
        fade = self._decay**trials
        self._hits = self._hits * fade + accepted
        self._tries = self._tries * fade + trials

    def fade(self, towards: float) -> None:
        """One trial's weight moves to ``towards``."""
        self._hits = self._hits * self._decay + towards * (1 - self._decay)
        self._tries = self._tries * self._decay + (1 - self._decay)


class Pacer:
    """When a sequence drafts, and how well its drafts have done (:attr:`acceptance`, which prices a draft's length
    in :func:`draft_length`). A new sequence starts from what the model's drafts did lately (``prior``)."""

    def __init__(self, settings: SpecSettings) -> None:
        self.settings = settings
        self.reset()

    def reset(self, prior: float = 0.5) -> None:
        self._pause, self._misses = 0, 0  # steps to wait before the next draft; failed drafts in a row
        self._record = Acceptance(prior)

    @property
    def acceptance(self) -> float:
        return self._record.rate

    def skipped(self, towards: float) -> None:
        """A draft was found but no length paid: the record fades towards ``towards`` (what the model's drafts did
        lately), so that a sequence that stopped drafting on a bad run tries again in a few steps. Towards even odds
        it never would where a draft pays only above them: on an EPYC whose 2 to 4 rows cost 2.4 times one, a
        sequence of the extraction benchmark whose acceptance fell under about 0.7 never drafted again."""
        self._record.fade(towards)

    def room(self, fits: int) -> int:
        """How many tokens to draft this step, ``fits`` at most; 0 while paused (which counts the step)."""
        if self._pause > 0:
            self._pause -= 1
            return 0
        return min(fits, self.settings.longest)

    def record(self, drafted: int, accepted: int) -> None:
        """Adapt to how much of a draft of ``drafted`` tokens the sampler accepted."""
        self._record.record(drafted, accepted)
        if accepted == 0:
            self._misses += 1
            self._pause = min(MAX_PAUSE, 2 ** (self._misses - 1)) if self._misses > 1 else 0
        else:
            self._misses = 0


class NgramIndex:
    """``ngram-simple``: one sequence's n-grams, each with the position after its latest earlier occurrence."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are indexed

    def reset(self) -> None:
        self._after, self._indexed = {}, 0

    def update(self, seq: list[int]) -> None:
        n = self.n
        # an n-gram is indexed once the token after it is known, so the sequence's own tail never finds itself
        for end in range(max(self._indexed, n), len(seq)):
            self._after[tuple(seq[end - n : end])] = end
        self._indexed = max(self._indexed, len(seq))

    def draft(self, seq: list[int], room: int) -> list[int]:
        if len(seq) < self.n:
            return []
        start = self._after.get(tuple(seq[-self.n :]))
        return [] if start is None else seq[start : start + room]


class NgramPool:
    """``ngram-mod``: the hash of every ``n``-token run any sequence of the model wrote, to the token that followed it
    last. Bounded: it starts over when it holds :attr:`capacity` runs, or when its drafts keep failing."""

    capacity = 1 << 18  # about 40 MB of Python ints at most
    #: rounds in a row accepting under a quarter of their drafts that clear the pool (llama-server's rule)
    failing_rounds = 5

    def __init__(self, n: int, n_min: int, n_max: int) -> None:
        self.n, self.n_min, self.n_max = n, n_min, n_max
        self._next: dict[int, int] = {}
        self._failing = 0

    def add(self, seq: list[int], start: int) -> None:
        """Record the runs of ``seq`` whose following token is at ``start`` or later."""
        n, table = self.n, self._next
        if len(table) >= self.capacity:
            table.clear()
        for end in range(max(start, n), len(seq)):
            table[hash(tuple(seq[end - n : end]))] = seq[end]

    def draft(self, seq: list[int], room: int) -> list[int]:
        n = self.n
        if len(seq) < n or room <= 0:
            return []
        key, out, table = list(seq[-n:]), [], self._next
        for _ in range(min(room, self.n_max)):
            token = table.get(hash(tuple(key)))
            if token is None:
                break
            out.append(token)
            key = [*key[1:], token]
        return out if len(out) >= min(self.n_min, room) else []

    def record(self, drafted: int, accepted: int) -> None:
        self._failing = self._failing + 1 if 4 * accepted < drafted else 0
        if self._failing >= self.failing_rounds:
            self._next.clear()
            self._failing = 0


class SeqDrafts:
    """One sequence's n-gram drafts and pace: its own index (``ngram-simple``) and the model's pool (``ngram-mod``),
    tried in the order ``--spec-type`` names them."""

    def __init__(self, settings: SpecSettings, pool: NgramPool | None = None) -> None:
        self.settings = settings
        self.pacer = Pacer(settings)
        self.tokens: list[int] = []
        self._index = NgramIndex(settings.ngram) if "ngram-simple" in settings.kinds else None
        self._pool = pool if "ngram-mod" in settings.kinds else None
        self._pooled = 0  # tokens given to the pool
        self.used_pool = False  # the last draft came from the pool

    def reset(self, tokens: list[int], prior: float = 0.5) -> None:
        """Start over on a new sequence: its prompt, and the acceptance its drafts start from."""
        self.tokens, self._pooled = [], 0
        self.pacer.reset(prior)
        if self._index is not None:
            self._index.reset()
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """The sequence grew by ``tokens`` (its prompt, sampled tokens)."""
        self.tokens.extend(tokens)
        if self._index is not None:
            self._index.update(self.tokens)
        if self._pool is not None:
            self._pool.add(self.tokens, self._pooled)
            self._pooled = len(self.tokens)

    def lookup(self, room: int) -> list[int]:
        """An n-gram draft of up to ``room`` tokens, or none (then a draft model or the MTP head may draft)."""
        self.used_pool = False
        for kind in self.settings.kinds:
            draft: list[int] = []
            if kind == "ngram-simple" and self._index is not None:
                draft = self._index.draft(self.tokens, min(room, self.settings.simple_max))
            elif kind == "ngram-mod" and self._pool is not None:
                draft = self._pool.draft(self.tokens, room)
                self.used_pool = bool(draft)
            if draft:
                return draft
        return []

    def record(self, drafted: int, accepted: int) -> None:
        self.pacer.record(drafted, accepted)
        if self.used_pool and self._pool is not None:
            self._pool.record(drafted, accepted)


def expected(acceptance: float, k: int) -> float:
    """The drafted tokens a draft of ``k`` is expected to keep, each accepted with ``acceptance`` once the ones
    before it were."""
    if acceptance >= 1.0:
        return float(k)
    return acceptance * (1 - acceptance**k) / (1 - acceptance)


def draft_length(
    acceptance: float,
    longest: int,
    rows: int,
    tokens: float,
    cost: list[float | None],
    per_token: float = 0.0,
) -> int:
    """How much of a draft of up to ``longest`` tokens to decode: the length that makes the step yield the most
    tokens per second, 0 when none beats no draft.

    Args:
        acceptance: The sequence's chance that a drafted token is accepted once the ones before it were.
        longest: The draft's length (an n-gram draft), or the most a draft model may draft.
        rows: The step's rows so far (every generating sequence's token, the drafts already given).
        tokens: The tokens the step is expected to yield so far.
        cost: A step's time by its rows (:meth:`~lemonkit.backends.llamacpp.step_costs.StepCosts.curve`).
        per_token: What drafting one token costs besides its row (a draft model's decode).
    """
    top = min(longest, len(cost) - 1 - rows)
    base = cost[rows] if 0 < rows < len(cost) else None
    if base is None:  # nothing measured yet: this step's time will be, at no more than twice its rows
        return max(0, min(top, rows))
    best, best_rate = 0, tokens / base
    for k in range(1, top + 1):
        seconds = cost[rows + k]
        assert seconds is not None  # the curve has every size once it has one
        rate = (tokens + expected(acceptance, k)) / (seconds + k * per_token)
        if rate > best_rate:
            best, best_rate = k, rate
    return best

"""One sequence's sampling state: its sampler chain (own seed), its grammar (sampled last) and its logprobs.

Every sequence of a batch samples from its own logits row (``llama_get_logits_ith`` with its batch index), so a
sequence's choices never depend on the others. Grammar-constrained output (``response_format``, forced tool calls)
samples as llama-server does, grammar last and only for rejected tokens: the ordinary chain picks a token, the
grammar checks just that one, and only a rejected token is picked again from the tokens the grammar allows. That is
3.4x faster than llama-cpp-python's grammar-first chain on Gemma's 262k vocab, with the same greedy output. The
second pick checks the highest logits only (:meth:`SeqSampler._allowed_top`) where that decides it as the whole
vocabulary would.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lemonkit.errors import InvalidArgument

__all__ = ["ReasoningBudget", "SeqSampler"]


#: how many of the highest logits a token the grammar refused is picked again from, when they decide the pick
#: (:meth:`SeqSampler._allowed_top`), then how many more, before the grammar is applied to the whole vocabulary
BEST_ALLOWED_TOP = 512
WIDER_ALLOWED_TOP = 16384
#: a margin on the sums that show the logits beyond those leave a sampled pick as it is: llama.cpp sums in float32
_MARGIN = 1e-3


class SeqSampler:
    """The sampler of one sequence.

    Args:
        llm: The loaded ``llama_cpp.Llama`` (its ``_init_sampler`` builds the same chain ``Llama.generate`` does).
        sampling: ``_init_sampler`` keyword arguments (temp, top_k, ...).
        seed: The chain's seed.
        grammar: GBNF the output must follow, or None.
        is_eog: Whether a token ends generation (the grammar is not fed those).

    Raises:
        InvalidArgument: The grammar does not parse.
    """

    def __init__(
        self,
        llm: Any,
        sampling: dict[str, Any],
        seed: int,
        grammar: str | None,
        is_eog: Callable[[int], bool],
        logit_bias: dict[int, float] | None = None,
        budget: ReasoningBudget | None = None,
    ) -> None:
        import llama_cpp as lc
        import numpy as np

        self._lc = lc
        self._n_vocab: int = llm.n_vocab()
        self._is_eog = is_eog
        # OpenAI's logit_bias: added to the logits row itself, so greedy, the chain, the grammar and logprobs all
        # see the biased logits
        self._budget = budget.fresh() if budget is not None else None
        self._bias: tuple[Any, Any] | None = None
        if logit_bias:
            ids = np.fromiter(logit_bias.keys(), dtype=np.intc)
            self._bias = (ids, np.fromiter(logit_bias.values(), dtype=np.single))
        # _init_sampler reads the seed from the Llama: only the decode thread builds samplers, one at a time
        llm.set_seed(seed)
        self._chain = llm._init_sampler(**sampling)
        #: greedy with neutral penalties is the argmax of the raw logits: taken straight from them, which skips
        #: copying Gemma's 262k logits into a candidate array (about 0.25 ms per token here) and the chain's pass
        self._argmax = sampling.get("temp") == 0.0 and _neutral_penalties(sampling)
        self._greedy = grammar is None and self._argmax
        #: a sampled pick under the grammar may come from the highest logits alone (:meth:`_sample_allowed`): the
        #: chain is then top-k, top-p, min-p and temperature on the logits as they are
        self._truncating = (
            sampling.get("temp", 0.0) > 0.0
            and _neutral_penalties(sampling)
            and sampling.get("typical_p", 1.0) >= 1.0
            and not sampling.get("mirostat_mode")
        )
        self._top_k = int(sampling.get("top_k", 40))
        self._top_p = float(sampling.get("top_p", 0.95))
        self._min_p = float(sampling.get("min_p", 0.05))
        self._grammar: Any = None
        if grammar is not None:
            self._grammar = lc.llama_sampler_init_grammar(llm._model.vocab, grammar.encode("utf-8"), b"root")
            if not self._grammar:
                self._chain.close()
                raise InvalidArgument("the response format or tool schema could not be turned into a grammar")
            self._init_candidates()

    def _init_candidates(self) -> None:
        import numpy as np

        lc = self._lc
        n_vocab = self._n_vocab
        dtype = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)
        self._cand = np.zeros(n_vocab, dtype=dtype)
        self._ids = np.arange(n_vocab, dtype=np.intc)
        self._cand_ptr = self._cand.ctypes.data_as(lc.llama_token_data_p)
        self._cur = lc.llama_token_data_array(data=self._cand_ptr, size=n_vocab, selected=-1, sorted=False)
        self._one = (lc.llama_token_data * 1)()
        self._one_ptr = ctypes.cast(self._one, lc.llama_token_data_p)
        self._single = lc.llama_token_data_array(data=self._one_ptr, size=1, selected=-1, sorted=False)

    def sample(self, ctx: Any, idx: int) -> int:
        """Pick the next token from logits row ``idx`` of the last decode and accept it into the sampler state."""
        budget = self._budget
        if budget is None:
            return self._sample(ctx, idx)
        token = budget.forced()
        if token is None:
            token = self._sample(ctx, idx)
        elif not self._greedy:
            self._lc.llama_sampler_accept(self._chain.sampler, token)  # penalties see it like a sampled token
        budget.accept(token)
        return token

    def _sample(self, ctx: Any, idx: int) -> int:
        lc = self._lc
        if self._bias is not None:
            self._logits(ctx, idx)[self._bias[0]] += self._bias[1]
        if self._greedy:
            return int(self._logits(ctx, idx).argmax())  # the first of equal maxima, as the greedy sampler picks
        if self._grammar is None:
            return int(lc.llama_sampler_sample(self._chain.sampler, ctx, idx))  # applies and accepts
        chain, grammar, cur = self._chain.sampler, self._grammar, self._cur
        if self._argmax:  # greedy under a grammar: the argmax if the grammar allows it, else the best it allows
            logits = self._logits(ctx, idx)
            token = int(logits.argmax())
            if not self._allows(token):
                # the best of the highest logits that the grammar allows is the best it allows
                for top in (BEST_ALLOWED_TOP, WIDER_ALLOWED_TOP):
                    ids, _, _ = self._allowed_top(logits, top)
                    if len(ids):
                        token = int(ids[0])
                        break
                else:
                    self._load_logits(ctx, idx)
                    lc.llama_sampler_apply(grammar, ctypes.byref(cur))
                    token = int(self._cand["id"][self._cand["logit"].argmax()])
            if not self._is_eog(token):
                lc.llama_sampler_accept(grammar, token)
            return token
        self._load_logits(ctx, idx)
        lc.llama_sampler_apply(chain, ctypes.byref(cur))
        token = int(cur.data[cur.selected].id)
        if not self._allows(token):  # the grammar rejects it: sample again, grammar first
            if not self._sample_allowed(self._logits(ctx, idx)):
                self._load_logits(ctx, idx)
                lc.llama_sampler_apply(grammar, ctypes.byref(cur))
                lc.llama_sampler_apply(chain, ctypes.byref(cur))
            token = int(cur.data[cur.selected].id)
        if not self._is_eog(token):  # the grammar aborts on an end token it does not expect; the caller stops there
            lc.llama_sampler_accept(grammar, token)
        lc.llama_sampler_accept(chain, token)
        return token

    def _allowed_top(self, logits: Any, top: int) -> tuple[Any, Any, float]:
        """The tokens among the ``top`` highest logits that the grammar allows, best first (the
        lowest id first among equal logits, as an argmax picks), their logits, and the lowest logit checked (-inf when
        all were): every token not checked has a lower one.

        One grammar pass over those candidates: llama.cpp decides each candidate on its own, so this is what the
        pass over the whole vocabulary says of them, for a fraction of its cost (that pass walks the grammar's
        stacks for each of Gemma's 262k tokens: 37 ms a row here, 13 rows of the extraction benchmark's 117 when
        greedy, 0.49 s of its 0.5 s of sampling). The token the grammar allows when the model wants another (a key
        in another order, prose before the JSON) lies near the top: ranks 77 and 109 at worst there.
        """
        import numpy as np

        lc = self._lc
        top = min(top, len(logits))
        best = np.argpartition(logits, -top)[-top:]
        floor = float(logits[best].min())
        ids = np.flatnonzero(logits >= floor)  # every token tied with the last one in, so ties resolve as argmax
        ids = ids[np.lexsort((ids, -logits[ids]))]
        self._load(ids, logits[ids], is_sorted=False)
        lc.llama_sampler_apply(self._grammar, ctypes.byref(self._cur))  # marks refused ones -inf, in place
        kept = ids[self._cand["logit"][: len(ids)] != -math.inf]
        return kept, logits[kept], floor if len(ids) < len(logits) else -math.inf

    def _sample_allowed(self, logits: Any) -> bool:
        """Sample the chain again from the tokens the grammar allows among the highest logits (the
        :data:`BEST_ALLOWED_TOP` highest, else the :data:`WIDER_ALLOWED_TOP` highest), when the tokens beyond them
        could not change the pick: the chain then draws the token (``self._cur``) that it draws after the grammar
        has gone over the whole vocabulary, from the same random number; False (nothing drawn) if they could.
        On the extraction benchmark's answers sampled at temperature 0.8, the first decided about 45% of the
        grammar's refusals, the second most of the rest.

        Those beyond the checked ones (all with a lower logit) are left out of the draw by top-k when it is full
        without them, else by top-p when its cut falls at the same place however much of them the grammar allows,
        else by min-p when they lie under its bound. Equal logits among the candidates fall back too: the chain
        sorts them in an order of its own, and the draw walks them in that order.
        """
        if not self._truncating or (self._top_k <= 0 and self._top_p >= 1.0):
            return False  # (with neither, the chain draws over the vocabulary in id order, not from a sorted list)
        return any(self._sample_top(logits, top) for top in (BEST_ALLOWED_TOP, WIDER_ALLOWED_TOP))

    def _sample_top(self, logits: Any, top: int) -> bool:
        import numpy as np

        ids, vals, floor = self._allowed_top(logits, top)
        k = self._top_k if self._top_k > 0 else len(logits)
        if len(ids) == 0:
            return False
        keep = ids[:k]
        kept = vals[: len(keep)]
        if len(ids) > k and vals[k] == vals[k - 1]:
            return False  # which of equal logits top-k keeps is the chain's own choice
        if len(np.unique(kept)) < len(kept):
            return False
        if len(ids) < k and floor > -math.inf:  # top-k could take unchecked tokens (each under ``floor``) too
            best = float(kept[0])
            under_min_p = self._min_p > 0.0 and floor - best < math.log(self._min_p) - _MARGIN
            if self._top_p < 1.0:
                cum = np.cumsum(np.exp(kept.astype(np.float64) - best))
                # the most the unchecked ones could add to top-p's sum: all of them, or top-k's room at ``floor``
                rest = float(np.exp(logits[logits < floor].astype(np.float64) - best).sum())
                beyond = min(rest, (k - len(ids)) * math.exp(floor - best))
                first = int(np.searchsorted(cum, self._top_p * cum[-1] * (1 - _MARGIN)))
                last = int(np.searchsorted(cum, self._top_p * (cum[-1] + beyond) * (1 + _MARGIN)))
                if (first != last or last >= len(cum)) and not (under_min_p and first >= len(cum) - 1):
                    return False
            elif not under_min_p:
                return False
        self._load(keep, kept, is_sorted=True)
        self._lc.llama_sampler_apply(self._chain.sampler, ctypes.byref(self._cur))
        return True

    def _allows(self, token: int, grammar: Any = None) -> bool:
        """Whether the grammar (``grammar``: a copy of it) accepts ``token`` next: one candidate, not the vocab."""
        single, one = self._single, self._one
        one[0].id, one[0].logit, one[0].p = token, 1.0, 0.0
        single.data, single.size, single.selected, single.sorted = self._one_ptr, 1, -1, False
        self._lc.llama_sampler_apply(grammar or self._grammar, ctypes.byref(single))
        return bool(single.data[0].logit != -math.inf)

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the output."""
        return self._grammar is not None

    def allowed(self, draft: list[int]) -> int:
        """How many of ``draft``'s first tokens the grammar allows from here, in order (a copy of the grammar walks
        them; this one is left as it is): a grammar's sequence speculates only tokens it could accept."""
        lc = self._lc
        if self._grammar is None:
            return len(draft)
        walker = lc.llama_sampler_clone(self._grammar)
        try:
            for i, token in enumerate(draft):
                if self._is_eog(token):
                    return i + 1  # generation ends there if the model agrees; nothing follows
                if not self._allows(token, walker):
                    return i
                lc.llama_sampler_accept(walker, token)
            return len(draft)
        finally:
            lc.llama_sampler_free(walker)

    def _load_logits(self, ctx: Any, idx: int) -> None:
        """The whole vocabulary as the candidates, in id order."""
        self._load(self._ids, self._logits(ctx, idx), is_sorted=False)

    def _load(self, ids: Any, logits: Any, *, is_sorted: bool) -> None:
        """``ids`` with their ``logits`` as the candidates (``self._cur``), sorted best first if ``is_sorted``."""
        # Samplers may repoint ``data``, shrink ``size`` and reorder: reset all of it each time.
        n, cand, cur = len(ids), self._cand, self._cur
        cand["id"][:n], cand["logit"][:n], cand["p"][:n] = ids, logits, 0.0
        cur.data, cur.size, cur.selected, cur.sorted = self._cand_ptr, n, -1, is_sorted

    def logprob(self, ctx: Any, idx: int, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
        """Log-probability of ``token`` and the ``n_top`` best alternatives, from logits row ``idx``."""
        import numpy as np

        logits = self._logits(ctx, idx)
        m = float(logits.max())
        lse = m + math.log(float(np.exp(logits - m).sum()))
        tops: list[tuple[int, float]] = []
        if n_top > 0:
            top = np.argpartition(logits, -n_top)[-n_top:]
            top = top[np.argsort(-logits[top])]
            tops = [(int(i), float(logits[i]) - lse) for i in top]
        return float(logits[token]) - lse, tops

    def _logits(self, ctx: Any, idx: int) -> Any:
        import numpy as np

        return np.ctypeslib.as_array(self._lc.llama_get_logits_ith(ctx, idx), shape=(self._n_vocab,))

    def close(self) -> None:
        if self._grammar is not None:
            self._lc.llama_sampler_free(self._grammar)
            self._grammar = None
        self._chain.close()


@dataclass
class ReasoningBudget:
    """A cap on the tokens of a sequence's reasoning: once ``limit`` tokens went into it, the close tag (``close``,
    as token ids, with the newlines the templates put around it) is written instead of what the model samples, as
    llama-server's ``--reasoning-budget`` does. Tags are matched on token ids, so counting costs nothing per token.
    """

    limit: int
    inside: bool  # the prompt opened the reasoning
    open_ids: list[int]
    close_ids: list[int]
    forced_ids: list[int]
    used: int = 0
    _queue: list[int] = field(default_factory=list)
    _recent: list[int] = field(default_factory=list)
    _closed: bool = False

    def fresh(self) -> ReasoningBudget:
        return ReasoningBudget(self.limit, self.inside, self.open_ids, self.close_ids, self.forced_ids)

    def forced(self) -> int | None:
        """The next token of a forced close, else None (sample as usual)."""
        if self.inside and not self._queue and self.used >= self.limit and not self._closed:
            self._queue = list(self.forced_ids)
            self._closed = True
        return self._queue.pop(0) if self._queue else None

    def accept(self, token: int) -> None:
        recent = self._recent
        recent.append(token)
        keep = max(len(self.open_ids), len(self.close_ids))
        if len(recent) > keep:
            del recent[: len(recent) - keep]
        if self.inside:
            if self.close_ids and recent[-len(self.close_ids) :] == self.close_ids:
                self.inside = False  # a forced close still writes the newlines after the tag
            elif not self._queue:
                self.used += 1
        elif not self._closed and self.open_ids and recent[-len(self.open_ids) :] == self.open_ids:
            self.inside, self.used = True, 0


def _neutral_penalties(sampling: dict[str, Any]) -> bool:
    return (
        sampling.get("repeat_penalty", 1.0) == 1.0
        and sampling.get("frequency_penalty", 0.0) == 0.0
        and sampling.get("presence_penalty", 0.0) == 0.0
    )

"""One sequence's sampling state: its sampler chain (own seed), its grammar (sampled last) and its logprobs.

Every sequence of a batch samples from its own logits row (``llama_get_logits_ith`` with its batch index), so a
sequence's choices never depend on the others. Grammar-constrained output (``response_format``, forced tool calls)
samples as llama-server does, grammar last and only for rejected tokens: the ordinary chain picks a token, the
grammar checks just that one, and only a rejected token costs a full grammar pass and a resample. That is 3.4x
faster than llama-cpp-python's grammar-first chain on Gemma's 262k vocab, with the same greedy output.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lemonkit.errors import InvalidArgument

__all__ = ["ReasoningBudget", "SeqSampler"]


#: how many of the highest logits greedy decoding under a grammar checks one by one before it applies the grammar to
#: the whole vocabulary (:meth:`SeqSampler._best_allowed`)
BEST_ALLOWED_TOP = 512


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
                best = self._best_allowed(logits)
                if best is None:
                    self._load_logits(ctx, idx)
                    lc.llama_sampler_apply(grammar, ctypes.byref(cur))
                    best = int(self._cand["id"][self._cand["logit"].argmax()])
                token = best
            if not self._is_eog(token):
                lc.llama_sampler_accept(grammar, token)
            return token
        self._load_logits(ctx, idx)
        lc.llama_sampler_apply(chain, ctypes.byref(cur))
        token = int(cur.data[cur.selected].id)
        if not self._allows(token):  # the grammar rejects it: sample again, grammar first
            self._load_logits(ctx, idx)
            lc.llama_sampler_apply(grammar, ctypes.byref(cur))
            lc.llama_sampler_apply(chain, ctypes.byref(cur))
            token = int(cur.data[cur.selected].id)
        if not self._is_eog(token):  # the grammar aborts on an end token it does not expect; the caller stops there
            lc.llama_sampler_accept(grammar, token)
        lc.llama_sampler_accept(chain, token)
        return token

    def _best_allowed(self, logits: Any) -> int | None:
        """The token greedy decoding under the grammar picks, if it is among the :data:`BEST_ALLOWED_TOP` highest
        logits: the first of them, best first and the lowest id among equal logits, that the grammar allows; None if
        none is.

        It is what applying the grammar to the whole vocabulary and taking the argmax gives, for much less: there
        llama.cpp walks the grammar's stacks for each of Gemma's 262k tokens (37 ms a row here; 13 rows of the
        extraction benchmark's 117, 0.49 s of its 0.5 s of sampling), where one candidate costs microseconds and the
        token the grammar allows when the model wants another (a key in another order, prose before the JSON) lies
        near the top (ranks 77 and 109 at worst there; all sampling then took 0.03 s).
        """
        import numpy as np

        top = min(BEST_ALLOWED_TOP, len(logits))
        best = np.argpartition(logits, -top)[-top:]
        floor = logits[best].min()
        ids = np.flatnonzero(logits >= floor)  # every token tied with the last one in, so ties resolve as argmax
        for token in ids[np.lexsort((ids, -logits[ids]))]:
            if self._allows(int(token)):
                return int(token)
        return None

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
        # Samplers may repoint ``data`` and shrink ``size``: reset the whole array each time.
        cand, cur = self._cand, self._cur
        cand["id"] = self._ids
        cand["logit"] = self._logits(ctx, idx)
        cand["p"] = 0.0
        cur.data, cur.size, cur.selected, cur.sorted = self._cand_ptr, self._n_vocab, -1, False

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

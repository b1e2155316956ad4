"""Token generation on one ``llama_cpp.Llama``: prompt evaluation, sampling (grammar last), stop strings, logprobs.

Generation runs our own loop over ``Llama.generate`` rather than ``create_completion(stream=True)``: the library's
streaming re-detokenizes the whole completion and rescans every stop string on each token (quadratic in the answer
length), needs ``logits_all=True`` (an n_ctx x n_vocab float buffer: 4 GB for Gemma 3 at 4096) for logprobs, and
cannot tell prompt time from generation time. The loop here caches each token's bytes once, decodes UTF-8
incrementally, matches stop strings only over the held-back tail, reads logprobs from the last logits row only when
asked, evaluates the prompt itself (exact ``prompt_ms``/``cache_n``) and checks ``cancelled()`` between tokens.
Grammar-constrained output (``response_format``, forced tool calls) samples as llama-server does, grammar last and
only for rejected tokens (:meth:`Generator._grammar_tokens`): 3.4x faster than llama-cpp-python's grammar-first
chain on Gemma's 262k vocab, same greedy output.
"""

from __future__ import annotations

import codecs
import ctypes
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lemonkit.backends.base import Cancelled
from lemonkit.backends.chat import StopMatcher
from lemonkit.backends.llamacpp.shapes import Run
from lemonkit.errors import InvalidArgument

if TYPE_CHECKING:
    from lemonkit.backends.llamacpp.vision import Vision

__all__ = ["DEFAULT_SAMPLING", "MAX_TOP_LOGPROBS", "Generator", "Job", "Sampling", "check_arg", "top_logprobs"]

#: llama-server's sampling defaults (``common_params_sampling``).
DEFAULT_SAMPLING: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}
MAX_TOP_LOGPROBS = 20

#: A generated token's logprob: (token, its bytes, logprob, [(alternative token, logprob)...]).
Logprob = tuple[int, bytes, float, list[tuple[int, float]]]


def check_arg(name: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise InvalidArgument(f"'{name}' must be {what}, got {value!r}")


def top_logprobs(name: str, value: Any, what: str = "an integer") -> int:
    """How many alternatives per token a request asks for (``logprobs`` / ``top_logprobs``)."""
    ok = isinstance(value, int) and 0 <= value <= MAX_TOP_LOGPROBS
    check_arg(name, value, ok, f"{what} from 0 to {MAX_TOP_LOGPROBS}")
    return int(value)


@dataclass
class Job:
    """One generation: the prompt and everything that shapes sampling."""

    tokens: list[int]
    sampling: dict[str, Any]
    seed: int
    max_tokens: int  # -1: until the context is full
    stops: list[str] = field(default_factory=list)
    grammar: str | None = None
    n_probs: int | None = None  # None: no logprobs; else top alternatives per token
    prompt: str = ""
    images: list[bytes] = field(default_factory=list)  # decoded image files (vision)


@dataclass
class Sampling:
    """A model's sampling defaults (llama-server's, then its ``llamacpp_args``), and a request's job built on them."""

    defaults: dict[str, Any]
    seed: int | None = None
    max_tokens: int = -1

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> Sampling:
        """Take the sampling settings out of parsed ``llamacpp_args`` (they are not ``Llama()`` arguments)."""
        defaults = {k: args.pop(k) if k in args else v for k, v in DEFAULT_SAMPLING.items()}
        return cls(defaults, args.pop("seed", None), args.pop("max_tokens", -1))

    def job(
        self,
        body: dict[str, Any],
        tokens: list[int],
        *,
        n_probs: int | None,
        prompt: str = "",
        extra_stops: list[str] | None = None,
        grammar: str | None = None,
    ) -> Job:
        """Validate the sampling parameters shared by chat and completions."""
        from llama_cpp import LLAMA_DEFAULT_SEED

        s = dict(self.defaults)
        g = body.get
        for key, lo, hi in (
            ("temperature", 0.0, None),
            ("top_p", 0.0, 1.0),
            ("min_p", 0.0, 1.0),
            ("typical_p", 0.0, 1.0),
            ("repeat_penalty", 1.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
            ("presence_penalty", -2.0, 2.0),
        ):
            v = g(key)
            if v is None:
                continue
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= lo
            ok = ok and (hi is None or v <= hi)
            check_arg(key, v, ok, f"a number from {lo} to {hi}" if hi is not None else f"a number >= {lo}")
            s[key] = float(v)
        top_k = g("top_k")
        if top_k is not None:
            check_arg("top_k", top_k, isinstance(top_k, int) and top_k >= 0, "an integer >= 0 (0: all tokens)")
            s["top_k"] = top_k
        sampling = {
            "temp": s["temperature"],
            "top_k": s["top_k"],
            "top_p": s["top_p"],
            "min_p": s["min_p"],
            "typical_p": s["typical_p"],
            "repeat_penalty": s["repeat_penalty"],
            "frequency_penalty": s["frequency_penalty"],
            "presence_penalty": s["presence_penalty"],
        }
        seed = g("seed")
        if seed is None:
            seed = self.seed
        check_arg("seed", seed, seed is None or (isinstance(seed, int) and not isinstance(seed, bool)), "an integer")
        # -1 (llama.cpp's "random") or none: a fresh seed; else the low 32 bits, as llama.cpp keeps
        seed = random.getrandbits(32) if seed is None or seed == -1 else seed & 0xFFFFFFFF
        if seed == LLAMA_DEFAULT_SEED:
            seed -= 1  # that value means "random" to the sampler

        max_tokens = g("max_tokens")
        if max_tokens is None:
            max_tokens = g("max_completion_tokens")
        if max_tokens is None:
            max_tokens = self.max_tokens
        check_arg(
            "max_tokens",
            max_tokens,
            isinstance(max_tokens, int) and (max_tokens >= 1 or max_tokens == -1),
            "a positive integer (or -1: until the context is full)",
        )

        stop = g("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(x, str) for x in stops):
            raise InvalidArgument("'stop' must be a string or an array of strings")
        stops = [x for x in stops + (extra_stops or []) if x]
        return Job(
            tokens=tokens,
            sampling=sampling,
            seed=seed,
            max_tokens=max_tokens,
            stops=stops,
            grammar=grammar,
            n_probs=n_probs,
            prompt=prompt,
        )


class Generator:
    """Generation on one loaded ``Llama``: one job at a time, each token's bytes cached across jobs.

    Args:
        llm: The loaded ``llama_cpp.Llama``.
        vision: Evaluates prompts that carry images (None: the model was loaded without an mmproj).
    """

    def __init__(self, llm: Any, vision: Vision | None = None) -> None:
        import llama_cpp

        self._lc = llama_cpp
        self._llm = llm
        self.vision = vision
        self.n_ctx: int = llm.n_ctx()
        self._n_vocab: int = llm.n_vocab()
        self._vocab = llm._model.vocab
        self._n_swa: int = int(llama_cpp.llama_model_n_swa(llm._model.model))  # 0: no sliding-window attention
        self.add_bos: bool = bool(llm._model.add_bos_token())
        self._bos: int = llm.token_bos()
        self.bos_text: str = llm._model.token_get_text(self._bos) if self._bos >= 0 else ""
        self._pieces: dict[int, tuple[bytes, bool, str | None]] = {}
        #: ``/v1/stats`` fields of the last generation (empty before the first)
        self.stats: dict[str, Any] = {}

    def tokenize(self, text: str) -> list[int]:
        """The prompt's tokens, refused when empty or when it leaves no room in the context."""
        # Templates usually write {{ bos_token }} themselves: keep one BOS, as llama-server does
        # (and spare llama.cpp's "2 BOS tokens" warning on every request).
        add_bos = self.add_bos and not (self.bos_text and text.startswith(self.bos_text))
        tokens: list[int] = self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        if self.add_bos and len(tokens) >= 2 and tokens[0] == tokens[1] == self._bos:
            tokens = tokens[1:]
        if not tokens:
            raise InvalidArgument("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise InvalidArgument(
                f"the request needs {len(tokens)} prompt tokens, more than the context size ({self.n_ctx}) allows"
            )
        return tokens

    def check_grammar(self, gbnf: str) -> None:
        """Refuse a grammar llama.cpp cannot parse (llama-cpp-python would add a NULL sampler and crash in C)."""
        sampler = self._lc.llama_sampler_init_grammar(self._vocab, gbnf.encode("utf-8"), b"root")
        if not sampler:
            raise InvalidArgument("the response format or tool schema could not be turned into a grammar")
        self._lc.llama_sampler_free(sampler)

    def token_bytes(self, token: int) -> bytes:
        return (self._pieces.get(token) or self._piece(token))[0]

    def _piece(self, token: int) -> tuple[bytes, bool, str | None]:
        """A token's bytes, whether it ends generation, and its text when the bytes decode alone (cached)."""
        buf = ctypes.create_string_buffer(64)
        n = self._lc.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
        raw = buf.raw[:n]
        try:
            text: str | None = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None  # part of a multi-byte character: goes through the incremental decoder
        entry = (raw, bool(self._lc.llama_vocab_is_eog(self._vocab, token)), text)
        self._pieces[token] = entry
        return entry

    def _prefill(self, tokens: list[int]) -> int:
        """Evaluate the prompt, reusing the longest cached prefix; return how many tokens were reused.

        Leaves the context exactly at ``tokens`` so ``Llama.generate`` samples without re-evaluating.
        """
        import numpy as np

        llm = self._llm
        n_cached = llm.n_tokens
        prefix = 0
        if n_cached > 0:
            m = min(n_cached, len(tokens))
            diff = np.nonzero(llm.input_ids[:m] != np.asarray(tokens[:m], dtype=np.intc))[0]
            prefix = int(diff[0]) if len(diff) else m
        if prefix == len(tokens) == n_cached and not getattr(llm, "_requires_eval", True):
            return prefix
        # At least one token must be evaluated to get fresh logits.
        reuse = min(prefix, len(tokens) - 1)
        if reuse > 0 and self._window_intact(reuse) and llm._ctx.kv_cache_seq_rm(-1, reuse, -1):
            llm.n_tokens = reuse
        else:
            llm.reset()
            llm._ctx.kv_cache_clear()
            reuse = 0
        llm.eval(tokens[reuse:])
        return reuse

    def _window_intact(self, n_past: int) -> bool:
        """Whether the context still holds every cell a prompt continued at ``n_past`` attends to.

        A sliding-window cache that is not full size (``swa_full`` off) drops the cells older than its window:
        continuing from a prefix whose window was dropped would silently change the output, so then the whole
        prompt is evaluated again (llama-server's rule). Full-size and ordinary caches keep position 0 onwards.
        """
        pos_min = int(self._lc.llama_memory_seq_pos_min(self._llm._ctx.memory, 0))
        return pos_min <= max(0, n_past - max(1, self._n_swa))

    def _logprob(self, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
        """Log-probability of ``token`` and the ``n_top`` best alternatives, from the logits it was sampled from."""
        import numpy as np

        ptr = self._lc.llama_get_logits_ith(self._llm._ctx.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        m = float(logits.max())
        lse = m + math.log(float(np.exp(logits - m).sum()))
        tops: list[tuple[int, float]] = []
        if n_top > 0:
            idx = np.argpartition(logits, -n_top)[-n_top:]
            idx = idx[np.argsort(-logits[idx])]
            tops = [(int(i), float(logits[i]) - lse) for i in idx]
        return float(logits[token]) - lse, tops

    def _grammar_tokens(self, gbnf: str, sampling: dict[str, Any]) -> Iterator[int]:
        """Sample under a grammar the way llama-server does: grammar last, and only when needed.

        ``Llama.generate`` puts the grammar first in the sampler chain, which checks every vocab
        entry against the grammar on every token (4x slower on Gemma's 262k vocab). Here the
        ordinary chain picks a token, the grammar checks just that one, and only a rejected
        token costs a full grammar pass and a resample. Expects the prompt already evaluated.
        """
        import numpy as np

        lc = self._lc
        llm = self._llm
        n_vocab = self._n_vocab
        chain = llm._init_sampler(**sampling)  # same chain (and seed) as Llama.generate builds
        grammar = lc.llama_sampler_init_grammar(self._vocab, gbnf.encode("utf-8"), b"root")
        if not grammar:
            raise InvalidArgument("the response format or tool schema could not be turned into a grammar")
        dtype = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)
        cand = np.zeros(n_vocab, dtype=dtype)
        ids = np.arange(n_vocab, dtype=np.intc)
        cand_ptr = cand.ctypes.data_as(lc.llama_token_data_p)
        cur = lc.llama_token_data_array(data=cand_ptr, size=n_vocab, selected=-1, sorted=False)
        one = (lc.llama_token_data * 1)()
        one_ptr = ctypes.cast(one, lc.llama_token_data_p)
        single = lc.llama_token_data_array(data=one_ptr, size=1, selected=-1, sorted=False)
        cur_ref, single_ref = ctypes.byref(cur), ctypes.byref(single)
        ctx = llm._ctx.ctx

        def load_logits() -> None:
            # Samplers may repoint ``data`` and shrink ``size``: reset the whole array each time.
            cand["id"] = ids
            cand["logit"] = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            cand["p"] = 0.0
            cur.data, cur.size, cur.selected, cur.sorted = cand_ptr, n_vocab, -1, False

        try:
            while True:
                load_logits()
                lc.llama_sampler_apply(chain.sampler, cur_ref)
                token = int(cur.data[cur.selected].id)
                one[0].id, one[0].logit, one[0].p = token, 1.0, 0.0
                single.data, single.size, single.selected, single.sorted = one_ptr, 1, -1, False
                lc.llama_sampler_apply(grammar, single_ref)
                if single.data[0].logit == -math.inf:  # the grammar rejects it: sample again, grammar first
                    load_logits()
                    lc.llama_sampler_apply(grammar, cur_ref)
                    lc.llama_sampler_apply(chain.sampler, cur_ref)
                    token = int(cur.data[cur.selected].id)
                eog = (self._pieces.get(token) or self._piece(token))[1]
                if not eog:  # the grammar aborts on an end token it does not expect; the caller stops there
                    lc.llama_sampler_accept(grammar, token)
                lc.llama_sampler_accept(chain.sampler, token)
                yield token
                llm.eval([token])
        finally:
            lc.llama_sampler_free(grammar)
            chain.close()

    def generate(self, job: Job, run: Run, cancelled: Cancelled) -> Iterator[tuple[str, Logprob | None]]:
        """Yield ``(text, logprob)`` per generated token; ``text`` may be "" while a stop string is undecided.

        ``logprob`` is None unless ``job.n_probs`` is set. Fills ``run`` and :attr:`stats` as it goes (also when the
        consumer stops early).
        """
        llm = self._llm
        t0 = time.perf_counter()
        if job.images:
            assert self.vision is not None  # images are refused at the request without one
            tokens = self.vision.prefill(job.prompt, job.images)
            run.cached = 0
        else:
            tokens = job.tokens
            run.cached = self._prefill(tokens)
        now = time.perf_counter()
        run.prompt_ms = (now - t0) * 1000.0
        run.prompt_tokens = len(tokens)
        room = self.n_ctx - len(tokens)
        max_tokens = room if job.max_tokens < 0 else min(job.max_tokens, room)
        run.finish_reason = "length"

        llm.set_seed(job.seed)
        if job.grammar is not None:
            gen: Any = self._grammar_tokens(job.grammar, job.sampling)
        else:
            gen = llm.generate(tokens, reset=True, **job.sampling)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decode = decoder.decode
        pending = False  # the decoder holds part of a character
        stopper = StopMatcher(job.stops) if job.stops else None
        pieces = self._pieces
        n_probs = job.n_probs
        times = run.times
        last = now
        n = 0
        try:
            if max_tokens <= 0:
                return
            for token in gen:
                t = time.perf_counter()
                entry = pieces.get(token) or self._piece(token)
                if entry[1]:  # end of generation
                    run.finish_reason = "stop"
                    break
                times.append(t - last)
                last = t
                if n == 0:
                    run.ttft = t - run.t_start
                n += 1
                run.generated = n
                text = entry[2]
                if text is None or pending:
                    text = decode(entry[0])
                    pending = bool(decoder.buffer)
                lp = None
                if n_probs is not None:
                    lp = (token, entry[0], *self._logprob(token, n_probs))
                if stopper is not None:
                    text = stopper.feed(text)
                    if stopper.stopped:
                        run.finish_reason = "stop"
                        yield text, lp
                        break
                yield text, lp
                if n >= max_tokens:
                    break
                if cancelled():
                    run.finish_reason = "cancelled"
                    break
            if run.finish_reason != "cancelled":
                tail = decode(b"", final=True)
                if stopper is not None:
                    tail = stopper.feed(tail) + stopper.finish()
                if tail:
                    yield tail, None
        finally:
            gen.close()
            if job.images:
                llm.reset()  # image positions hold no token ids: never prefix-match them
            self._record(run)

    def _record(self, run: Run) -> None:
        decode_s = sum(run.times)
        self.stats = {
            "time_to_first_token": run.ttft if run.generated else (time.perf_counter() - run.t_start),
            "tokens_per_second": run.generated / decode_s if decode_s > 0 else 0.0,
            "input_tokens": run.prompt_tokens - run.cached,
            "output_tokens": run.generated,
            "decode_token_times": list(run.times),
            "prompt_tokens": run.prompt_tokens,
            "cache_tokens": run.cached,  # prompt tokens reused from the context, not evaluated again
        }

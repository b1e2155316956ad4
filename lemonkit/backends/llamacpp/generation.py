"""Token generation: requests go to the model's decode thread (:mod:`~lemonkit.backends.llamacpp.batch`), which
batches them; each request's own thread turns its tokens into text here.

The text side caches each token's bytes once, decodes UTF-8 incrementally, matches stop strings only over the held-
back tail and checks ``cancelled()`` between tokens. Prompt evaluation (with the slot's prefix cache), sampling
(grammar last, :mod:`~lemonkit.backends.llamacpp.sampler`) and logprobs (from the sequence's own logits row, so no
``logits_all`` buffer) happen on the decode thread.
"""

from __future__ import annotations

import codecs
import ctypes
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lemonkit.backends.chat import StopMatcher
from lemonkit.backends.llamacpp.answers import Run
from lemonkit.backends.llamacpp.batch import Batcher, End
from lemonkit.backends.llamacpp.cpu_turns import Turn, any_cores
from lemonkit.backends.llamacpp.drafts import SpecSettings
from lemonkit.backends.llamacpp.jobs import Job, Logprob
from lemonkit.backends.protocol import Cancelled
from lemonkit.errors import InvalidArgument
from lemonkit.formats.generation_metrics import GenerationTotals

if TYPE_CHECKING:
    from lemonkit.backends.llamacpp.draft_model import DraftModel
    from lemonkit.backends.llamacpp.mtp import MtpHead
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


def check_arg(name: str, value: Any, ok: bool, what: str) -> None:
    if not ok:
        raise InvalidArgument(f"'{name}' must be {what}, got {value!r}")


def top_logprobs(name: str, value: Any, what: str = "an integer") -> int:
    """How many alternatives per token a request asks for (``logprobs`` / ``top_logprobs``)."""
    ok = isinstance(value, int) and 0 <= value <= MAX_TOP_LOGPROBS
    check_arg(name, value, ok, f"{what} from 0 to {MAX_TOP_LOGPROBS}")
    return int(value)


@dataclass
class Sampling:
    """A model's sampling defaults (llama-server's, then its ``llamacpp_args``), and a request's job built on them."""

    defaults: dict[str, Any]
    seed: int | None = None
    max_tokens: int = -1
    n_vocab: int = 0x7FFFFFFF  # the model's, set once it is loaded (bounds logit_bias ids)
    grammar: str | None = None  # --grammar: what answers follow unless a request brings its own
    reasoning_budget: int = -1  # --reasoning-budget: -1 no limit

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> Sampling:
        """Take the sampling settings out of parsed ``llamacpp_args`` (they are not ``Llama()`` arguments)."""
        defaults = {k: args.pop(k) if k in args else v for k, v in DEFAULT_SAMPLING.items()}
        return cls(
            defaults,
            args.pop("seed", None),
            args.pop("max_tokens", -1),
            grammar=args.pop("grammar", None),
            reasoning_budget=args.pop("reasoning_budget", -1),
        )

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
        cache_prompt = g("cache_prompt", True)
        check_arg("cache_prompt", cache_prompt, isinstance(cache_prompt, bool), "a boolean")
        priority = g("priority", 0)
        check_arg("priority", priority, isinstance(priority, int) and not isinstance(priority, bool), "an integer")
        logit_bias = parse_logit_bias(g("logit_bias"), self.n_vocab)
        return Job(
            tokens=tokens,
            sampling=sampling,
            seed=seed,
            max_tokens=max_tokens,
            stops=stops,
            grammar=grammar,
            n_probs=n_probs,
            prompt=prompt,
            cache_prompt=cache_prompt,
            logit_bias=logit_bias,
            priority=priority,
        )


def parse_logit_bias(value: Any, n_vocab: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (``{"token id": bias}``, bias from -100 to 100) or llama-server's list form
    (``[[id, bias], ...]``, ``false`` for a ban) as token id -> bias; -100 and ``false`` ban the token."""
    if value is None:
        return {}
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise InvalidArgument("logit_bias: expected an object of token id -> bias (or llama-server's [[id, bias]])")
    out: dict[int, float] = {}
    for key, bias in pairs:
        try:
            token = int(key) if not isinstance(key, bool) else -1
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < n_vocab:
            raise InvalidArgument(f"logit_bias: {key!r} is not a token id of this model (0 to {n_vocab - 1})")
        if bias is False:
            bias = -math.inf
        ok = isinstance(bias, int | float) and not isinstance(bias, bool) and (-100 <= bias <= 100 or bias == -math.inf)
        if not ok:
            raise InvalidArgument(f"logit_bias[{key!r}]: expected a number from -100 to 100, got {bias!r}")
        out[token] = -math.inf if bias <= -100 else float(bias)
    return out


class Generator:
    """Generation on one loaded ``Llama``: ``n_parallel`` jobs at a time, each token's bytes cached across jobs.

    Args:
        llm: The loaded ``llama_cpp.Llama``, its context built for ``n_parallel`` sequences, one more when
            ``invariant`` (:func:`~lemonkit.backends.llamacpp.batch.parallel_context`).
        vision: Evaluates prompts that carry images (None: the model was loaded without an mmproj).
        n_parallel: Jobs generated together.
        n_batch: Tokens decoded per step.
        invariant: The model runs on batch-invariant kernels; the batcher keeps the extra sequence for padding.
        turn: Entered around every decode: CPU cores for its threads.
        cache_ram: Bytes of host memory for prompts evicted from the slots (0: none, negative: no bound).
        prefill_budget: Prompt tokens a step takes while sequences generate (None: measured).
        spec: Speculative decoding; with ``invariant`` the context holds one more sequence for rejected drafts.
        draft_model: The draft model of ``draft-simple`` (closed with the generator), or None.
        mtp: The MTP head of ``draft-mtp`` (closed with the generator), or None.
    """

    def __init__(
        self,
        llm: Any,
        vision: Vision | None = None,
        *,
        n_parallel: int = 1,
        n_batch: int = 512,
        invariant: bool = False,
        turn: Turn = any_cores,
        cache_ram: int = 0,
        prefill_budget: int | None = None,
        spec: SpecSettings | None = None,
        draft_model: DraftModel | None = None,
        mtp: MtpHead | None = None,
    ) -> None:
        import llama_cpp

        self._lc = llama_cpp
        self._llm = llm
        self.vision = vision
        self.n_ctx: int = llm.n_ctx()
        self._vocab = llm._model.vocab
        self.add_bos: bool = bool(llm._model.add_bos_token())
        self._bos: int = llm.token_bos()
        self.bos_text: str = llm._model.token_get_text(self._bos) if self._bos >= 0 else ""
        self._pieces: dict[int, tuple[bytes, bool, str | None]] = {}
        self._special: set[int] = set()  # special tokens rendered as text (see preserve)
        #: ``/v1/stats`` fields of the last generation to finish (empty before the first)
        self.stats: dict[str, Any] = {}
        #: every generation's figures since the load (the sidecar's /metrics)
        self.totals = GenerationTotals()
        self._batcher = Batcher(
            llm,
            n_parallel=n_parallel,
            n_batch=n_batch,
            is_eog=self._is_eog,
            n_swa=int(llama_cpp.llama_model_n_swa(llm._model.model)),
            vision=vision,
            spare_seq=n_parallel if invariant else None,
            turn=turn,
            cache_ram=cache_ram,
            prefill_budget=prefill_budget,
            spec=spec,
            retire_seq=n_parallel + 1 if invariant and spec is not None and spec.on else None,
            draft_model=draft_model,
            mtp=mtp,
        )

    @property
    def n_parallel(self) -> int:
        return self._batcher.n_parallel

    def close(self) -> None:
        """Stop the decode thread (before the model is freed)."""
        self._batcher.close()

    #: what a request that does not fit is told besides the figures (how to give the model a larger context)
    context_hint = ""

    def slots(self) -> list[dict[str, Any]]:
        """Each slot's state, read off the batcher as it runs (plain fields: a consistent enough snapshot)."""
        return self._batcher.slots()

    def slot_action(self, slot_id: int, action: str, path: str | None) -> dict[str, Any]:
        """``save`` an idle slot's prompt to ``path``, ``restore`` one from it, or ``erase`` it (on the decode
        thread, between steps)."""
        if action == "erase":
            return self._batcher.erase_slot(slot_id)
        if path is None:
            raise InvalidArgument(f"action {action}: a file is required")
        if action == "save":
            return self._batcher.save_slot(slot_id, path)
        if action == "restore":
            return self._batcher.restore_slot(slot_id, path)
        raise InvalidArgument(f"action must be save, restore or erase, got {action!r}")

    def tokenize(self, text: str, *, fit: bool = True) -> list[int]:
        """The prompt's tokens, refused when empty or (``fit``) when it leaves no room in the context."""
        # Templates usually write {{ bos_token }} themselves: keep one BOS, as llama-server does
        # (and spare llama.cpp's "2 BOS tokens" warning on every request).
        add_bos = self.add_bos and not (self.bos_text and text.startswith(self.bos_text))
        tokens: list[int] = self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        if self.add_bos and len(tokens) >= 2 and tokens[0] == tokens[1] == self._bos:
            tokens = tokens[1:]
        if not tokens:
            raise InvalidArgument("the prompt is empty")
        if fit and len(tokens) >= self.n_ctx:
            raise InvalidArgument(
                f"the request needs {len(tokens)} prompt tokens, more than the context size ({self.n_ctx}) allows"
                + self.context_hint
            )
        return tokens

    def check_grammar(self, gbnf: str) -> None:
        """Refuse a grammar llama.cpp cannot parse (llama-cpp-python would add a NULL sampler and crash in C)."""
        sampler = self._lc.llama_sampler_init_grammar(self._vocab, gbnf.encode("utf-8"), b"root")
        if not sampler:
            raise InvalidArgument("the response format or tool schema could not be turned into a grammar")
        self._lc.llama_sampler_free(sampler)

    def fim_tokens(self, prefix: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt (``suffix`` on completions): prefix, suffix and middle tokens around the two
        texts, as llama-server's ``/infill`` lays them out. Refused for a model without FIM tokens."""
        lc, vocab = self._lc, self._vocab
        pre, suf, mid = lc.llama_vocab_fim_pre(vocab), lc.llama_vocab_fim_suf(vocab), lc.llama_vocab_fim_mid(vocab)
        if min(pre, suf, mid) < 0:
            raise InvalidArgument(
                "'suffix' needs a model trained for fill-in-the-middle (its vocabulary has no FIM tokens); "
                "send the text before and after in the prompt instead"
            )

        def text(t: str) -> list[int]:
            return list(self._llm.tokenize(t.encode("utf-8"), add_bos=False, special=False)) if t else []

        tokens = ([self._bos] if self.add_bos and self._bos >= 0 else []) + [
            pre,
            *text(prefix),
            suf,
            *text(suffix),
            mid,
        ]
        if len(tokens) >= self.n_ctx:
            raise InvalidArgument(
                f"the request needs {len(tokens)} prompt tokens, more than the context size ({self.n_ctx}) allows"
                + self.context_hint
            )
        return tokens

    def special_ids(self, text: str) -> list[int]:
        """``text`` as token ids, special tokens parsed (no BOS): how a tag the model writes looks to the sampler."""
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    def preserve(self, texts: tuple[str, ...]) -> None:
        """Render the special tokens spelled ``texts`` as their text (llama.cpp renders control tokens as nothing):
        the chat format's markup, which the output parser reads, as llama-server's preserved tokens."""
        for text in texts:
            ids = self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            if len(ids) == 1 and not self._lc.llama_vocab_is_eog(self._vocab, ids[0]):
                self._special.add(ids[0])
                self._pieces.pop(ids[0], None)

    def token_bytes(self, token: int) -> bytes:
        return (self._pieces.get(token) or self._piece(token))[0]

    def _piece(self, token: int) -> tuple[bytes, bool, str | None]:
        """A token's bytes, whether it ends generation, and its text when the bytes decode alone (cached)."""
        buf = ctypes.create_string_buffer(64)
        special = token in self._special
        n = self._lc.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        raw = buf.raw[:n]
        try:
            text: str | None = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None  # part of a multi-byte character: goes through the incremental decoder
        entry = (raw, bool(self._lc.llama_vocab_is_eog(self._vocab, token)), text)
        self._pieces[token] = entry
        return entry

    def _is_eog(self, token: int) -> bool:
        return (self._pieces.get(token) or self._piece(token))[1]

    def generate(self, job: Job, run: Run, cancelled: Cancelled) -> Iterator[tuple[str, Logprob | None]]:
        """Yield ``(text, logprob)`` per generated token; ``text`` may be "" while a stop string is undecided.

        ``logprob`` is None unless ``job.n_probs`` is set. Fills ``run`` and :attr:`stats` as it goes (also when the
        consumer stops early, which frees the job's slot at the decode thread's next step).
        """
        seq = self._batcher.submit(job, run, cancelled)
        run.finish_reason = "length"
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decode = decoder.decode
        pending = False  # the decoder holds part of a character
        stopper = StopMatcher(job.stops) if job.stops else None
        pieces = self._pieces
        times = run.times
        last = 0.0
        n = 0
        try:
            for item in seq.events():
                if isinstance(item, End):
                    if item.reason == "cancelled":
                        run.finish_reason = "cancelled"
                    break
                token, tail = item
                t = time.perf_counter()
                entry = pieces.get(token) or self._piece(token)
                if entry[1]:  # end of generation
                    run.finish_reason = "stop"
                    break
                times.append(t - (last or seq.prefilled_at))
                last = t
                if n == 0:
                    run.ttft = t - run.t_start
                n += 1
                run.generated = n
                text = entry[2]
                if text is None or pending:
                    text = decode(entry[0])
                    pending = bool(decoder.buffer)
                lp = None if tail is None else (token, entry[0], *tail)
                if stopper is not None:
                    text = stopper.feed(text)
                    if stopper.stopped:
                        run.finish_reason, run.stop_word = "stop", stopper.matched
                        yield text, lp
                        break
                yield text, lp
                if cancelled():
                    run.finish_reason = "cancelled"
                    break
            if run.finish_reason != "cancelled":
                tail_text = decode(b"", final=True)
                if stopper is not None:
                    tail_text = stopper.feed(tail_text) + stopper.finish()
                if tail_text:
                    yield tail_text, None
        finally:
            seq.done = True
            self._record(run)

    def _record(self, run: Run) -> None:
        self.totals.record(
            prompt_tokens=run.prompt_tokens,
            cached_tokens=run.cached,
            ttft=run.ttft if run.generated else None,
            token_times=run.times,
            prompt_seconds=run.prompt_ms / 1000.0,
        )
        decode_s = sum(run.times)
        self.stats = {
            "time_to_first_token": run.ttft if run.generated else (time.perf_counter() - run.t_start),
            "tokens_per_second": run.generated / decode_s if decode_s > 0 else 0.0,
            "input_tokens": run.prompt_tokens - run.cached,
            "output_tokens": run.generated,
            "decode_token_times": list(run.times),
            "prompt_tokens": run.prompt_tokens,
            "cache_tokens": run.cached,  # prompt tokens reused from the context, not evaluated again
            "decode_threads": run.decode_threads,
            **({"draft_n": run.drafted, "draft_n_accepted": run.accepted} if run.drafted else {}),
        }

"""Continuous batching: one decode thread steps every active sequence of a model in one ``llama_decode``.

The context holds ``n_parallel`` sequences (slots) in one unified KV cache, as llama-server's default does, so one
request may still use the whole context. With batch-invariant kernels (:mod:`~lemonkit.backends.llamacpp.kernels`,
the default) a sequence's logits are the same bits whatever else shares its steps and however its prompt is
chunked, so a request answers exactly as it would alone.

Each step builds one ``llama_batch`` holding every generating slot's last token and then chunks of newcomers'
prompts (chunked prefill), shortest prompt first. Decoding goes first: while any sequence generates, the prompts of a
step get at most the prefill budget (``--prefill-budget``; by default as many tokens as measured to cost what the
generating rows' own decode costs, so a stream keeps about half its rate while another request's long prompt is
evaluated, and the prompt about half of its own; alone, a prompt takes the whole ``n_batch``). After the decode
each slot samples from its own logits row with its own sampler
(:class:`~lemonkit.backends.llamacpp.sampler.SeqSampler`) and hands the token to its request's thread, which turns
tokens into text (:class:`~lemonkit.backends.llamacpp.generation.Generator`).

Requests carry a priority (vLLM's ``priority`` field: lower first; a batch's rows are 1, behind interactive requests'
0): the most urgent waiting request takes the next free slot, its prompt is evaluated in steps of the most urgent
requests alone, and while it generates a less urgent prompt gets at most :data:`BEHIND_PREFILL` tokens of a step: a
chat sent during a batch is neither held behind the batch's prefill nor slowed by it.

New requests join at the next step; a finished, stopped or cancelled one frees its slot at once. An idle slot keeps
its tokens as a prompt cache: a newcomer takes the idle slot sharing its longest prefix (llama-server's slot
similarity) and evaluates only the rest; when another slot, busy or idle, holds a longer prefix, its cells for it
are shared with the newcomer's sequence, so the rows of one template evaluate the instruction once. With a RAM cache
(``--cache-ram``, :mod:`~lemonkit.backends.llamacpp.prompt_cache`) a slot's cache that a newcomer would cut back is
saved to host memory first, and a newcomer that shares more with a saved prompt than with its slot has that prompt
restored into the slot. When the KV cache is full, idle slots' caches go first (to the RAM cache, if there is one);
if that is not enough, the newest sequence ends with finish_reason "length".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lemonkit.backends.llamacpp.cpu_turns import Turn, any_cores, on_cores
from lemonkit.backends.llamacpp.drafts import Acceptance, NgramPool, SeqDrafts, SpecSettings, draft_length, expected
from lemonkit.backends.llamacpp.prompt_cache import PromptCache, common_prefix
from lemonkit.backends.llamacpp.sampler import SeqSampler
from lemonkit.backends.llamacpp.step_costs import StepCosts
from lemonkit.backends.protocol import Cancelled
from lemonkit.errors import InvalidArgument, SlotBusy

if TYPE_CHECKING:
    from lemonkit.backends.llamacpp.answers import Run
    from lemonkit.backends.llamacpp.draft_model import DraftModel
    from lemonkit.backends.llamacpp.jobs import Job
    from lemonkit.backends.llamacpp.mtp import MtpHead
    from lemonkit.backends.llamacpp.vision import Vision

__all__ = ["Batcher", "End", "Seq", "parallel_context"]

#: The share of a prompt an idle slot's cache must hold for the prompt to go there (llama-server's default).
SIMILARITY = 0.1
#: The fewest prompt tokens worth sharing from another slot's cells (a copy of fewer saves next to nothing).
MIN_SHARED = 16
#: Prompt tokens a step gives requests of a later priority (a batch's rows) while a more urgent one is under way:
#: enough that they advance, few enough that the urgent request's steps stay about as short as a decode's.
BEHIND_PREFILL = 32
#: Prompt tokens a step gives while sequences generate, before a step's costs were measured (``auto`` budget).
FIRST_PREFILL = 16
#: The fewest prompt tokens an ``auto`` budget's step takes while sequences generate, when the prompt has that many
#: left: a step with prompt rows costs more than its tokens (over a long context, the prompt rows' attention walks
#: every cell of it whatever their number), so a budget of fewer tokens a step is saved up over steps without
#: prompt tokens and spent in one (measured on Gemma 3 270M beside a 6k-token prompt, 2 cores: a step of 1 decode
#: row took 14 ms, with 8 prompt tokens 64 ms, with 64 about 200 ms).
PREFILL_CHUNK = 64
#: The weight of the newest step in the measured cost of a prompt token (it grows with the prompt's position).
_COST_WEIGHT = 0.3
#: Steps between two steps left to the generating rows alone while their decode has not been measured.
_MEASURE_EVERY = 16

#: A generated token as the decode thread hands it over: (token, (logprob, alternatives) or None).
Token = tuple[int, tuple[float, list[tuple[int, float]]] | None]


@dataclass(frozen=True)
class End:
    """The decode thread ended a sequence (``reason``: "length" or "cancelled"); no token follows."""

    reason: str


@dataclass
class Seq:
    """One request's generation as the batcher sees it; its thread reads :meth:`events`."""

    job: Job
    run: Run
    cancelled: Cancelled
    _events: queue.SimpleQueue[Token | End | BaseException] = field(default_factory=queue.SimpleQueue)
    #: the reader stopped (a stop string, max_tokens, the client left): free the slot at the next step
    done: bool = False
    #: when its prompt was evaluated (``time.perf_counter()``), set before its first token
    prefilled_at: float = 0.0

    def events(self) -> Iterator[Token | End]:
        """The tokens, until an :class:`End` (also yielded). Raises what the decode thread failed with."""
        while True:
            item = self._events.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, End):
                return


@dataclass
class _Slot:
    id: int
    tokens: list[int] = field(default_factory=list)  # the ids whose K/V the slot's sequence holds, from position 0
    reusable: bool = True  # False after images: their positions hold no token ids
    used: float = 0.0  # last admission: the least recently used idle slot gives its cache up first
    seq: Seq | None = None
    sampler: SeqSampler | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to evaluate
    n_past: int = 0  # positions filled
    last: int = -1  # the sampled token the next step decodes (-1: still prefilling)
    n_gen: int = 0
    limit: int = 0  # tokens it may generate
    t_admit: float = 0.0
    idx: int = -1  # its logits row in this step's batch (-1: none)
    drafts: SeqDrafts | None = None  # with speculative decoding
    draft: list[int] = field(default_factory=list)  # this step's draft, decoded after ``last``
    #: (leader slot, its request, tokens shared): this prompt waits for the leader's to get that far, then shares
    #: its cells (rows of one template admitted together evaluate the instruction once, not once per slot)
    follow: tuple[_Slot, Seq, int] | None = None


def _priority(slot: _Slot) -> int:
    """The priority of the request a busy slot serves (lower: more urgent)."""
    assert slot.seq is not None
    return slot.seq.job.priority


@contextlib.contextmanager
def parallel_context(n_seq: int, *, repack: bool = True, mtp: bool = False, n_rs_seq: int = 0) -> Iterator[None]:
    """Make the ``llama_cpp.Llama`` created inside build its context for ``n_seq`` sequences in a unified cache.

    ``Llama()`` has no such arguments (0.3.36): it sets only the fields it knows, so the model and context classes
    it calls are wrapped for the duration. ``repack=False`` is llama-server's ``--no-repack``: weights stay in their
    file layout instead of the CPU's gemm-friendly one; ``mtp`` loads the model's MTP layers too (skipped otherwise);
    ``n_rs_seq`` is how many tokens back a recurrent layer's state can be rolled back (llama.cpp keeps a state per
    token of a sequence's last decode, up to that many, where the architecture supports it; others ignore it).
    Load one model at a time (a sidecar loads one).
    """
    from llama_cpp import llama as llama_module

    internals = llama_module.internals
    context_class, model_class = internals.LlamaContext, internals.LlamaModel

    class ParallelContext(context_class):  # type: ignore[misc, valid-type]
        def __init__(self, *, model: Any, params: Any, verbose: bool = True) -> None:
            params.n_seq_max = n_seq
            params.kv_unified = True  # one sequence may fill the whole context, as in llama-server
            params.n_rs_seq = n_rs_seq
            super().__init__(model=model, params=params, verbose=verbose)

    class Model(model_class):  # type: ignore[misc, valid-type]
        def __init__(self, *, path_model: str, params: Any, verbose: bool = True) -> None:
            params.use_extra_bufts = repack
            params.load_mtp = mtp
            super().__init__(path_model=path_model, params=params, verbose=verbose)

    internals.LlamaContext, internals.LlamaModel = ParallelContext, Model  # type: ignore[misc]
    try:
        yield
    finally:
        internals.LlamaContext, internals.LlamaModel = context_class, model_class  # type: ignore[misc]


class Batcher:
    """The decode thread of one model and its ``n_parallel`` slots.

    Args:
        llm: The loaded ``llama_cpp.Llama``, its context built for ``n_parallel`` sequences.
        n_parallel: Sequences decoded together.
        n_batch: Tokens per step (generating slots first, then prompt chunks).
        is_eog: Whether a token ends generation.
        n_swa: The model's sliding window (0: none), for the prefix-reuse guard.
        vision: Evaluates prompts with images (None: no mmproj).
        spare_seq: A sequence id beside the slots' (the context holds ``n_parallel + 1``) for a throwaway row that
            keeps every step at two rows or more when the model's kernels round one row differently from several
            (:mod:`~lemonkit.backends.llamacpp.kernels`); None: steps run as they come.
        turn: Entered around every decode: CPU cores for its threads (:mod:`~lemonkit.backends.llamacpp.cpu_turns`).
        cache_ram: Bytes of host memory for prompts evicted from the slots (0: none, negative: no bound).
        spec: Speculative decoding (:mod:`~lemonkit.backends.llamacpp.drafts`); None: none.
        draft_model: Drafts for ``draft-simple`` (the batcher closes it); None: none.
        mtp: Drafts for ``draft-mtp``: the target's next-n head, which the batcher keeps in step with every decode
            (the batcher closes it); None: none.
        retire_seq: With ``spare_seq`` and ``spec``, a sequence id that takes over rejected drafts' cells, so that
            no cell below another sequence's is freed (see :meth:`_retire`).
        prefill_budget: Prompt tokens a step gives while sequences generate (``--prefill-budget``); None: as many
            as cost what the generating rows' decode costs (measured, see :meth:`_prefill_room`).
    """

    def __init__(
        self,
        llm: Any,
        *,
        n_parallel: int,
        n_batch: int,
        is_eog: Callable[[int], bool],
        n_swa: int,
        vision: Vision | None,
        spare_seq: int | None = None,
        turn: Turn = any_cores,
        cache_ram: int = 0,
        spec: SpecSettings | None = None,
        retire_seq: int | None = None,
        draft_model: DraftModel | None = None,
        mtp: MtpHead | None = None,
        prefill_budget: int | None = None,
    ) -> None:
        import llama_cpp as lc
        import numpy as np

        self._lc = lc
        self._llm = llm
        self._ctx = llm._ctx.ctx
        self._mem = lc.llama_get_memory(self._ctx)
        self.n_ctx: int = llm.n_ctx()
        self._is_eog = is_eog
        self._n_swa = n_swa
        self._vision = vision
        self._slots = [_Slot(i) for i in range(n_parallel)]
        self._order: list[_Slot] = []  # active slots, oldest admission first (prefill order, eviction order)
        self._outbox: list[tuple[Seq, Token | End | BaseException]] = []  # a step's results, until it is sent
        self._waiting: deque[Seq] = deque()
        self._controls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()  # run between steps (slot actions)
        self._cond = threading.Condition()
        self._closed = False
        self._spare = spare_seq
        self._turn = turn
        self._n_batch = n_batch - (spare_seq is not None)  # a row stays free for the padding row
        self._prefill_budget = prefill_budget
        #: seconds a prompt token adds to a step, from recent steps that evaluated prompts (None: none yet)
        self._prompt_cost: float | None = None
        self._unmeasured = 0  # steps that found the generating rows' decode unmeasured
        self._prefill_saved = 0.0  # prompt tokens an auto budget saved up in steps without prompt tokens
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        b = self._batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n_batch,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(n_batch,))
        self._logits = np.ctypeslib.as_array(b.logits, shape=(n_batch,))
        self._nseq[:] = 1
        #: pad steps of one row (or one output) with a throwaway row of the spare sequence (probed by the decode
        #: thread: every llama_decode of a context runs on one thread, as a second OpenMP team in the process
        #: slowed decoding by a third)
        self.pads_single_rows = False
        #: a removal left free cells below others' cells: compact before the next decode (see _compact)
        self._compact_due = False
        #: ``-t`` and ``-tb``: the most threads of a generation step, and the threads of any other decode
        self._threads = (lc.llama_n_threads(self._ctx), lc.llama_n_threads_batch(self._ctx))
        self._threads_set = self._threads
        #: generation steps' times by how they were decoded, which decide their threads and parts
        self.costs = StepCosts(self._threads[0])
        #: a decode of the step got fewer cores than it asked for (other sidecars held them): it measured them
        self._short = False
        self._used = self._threads[0]  # the threads of the last decode
        self._decode_s = 0.0  # how long the last llama_decode took
        self.cache = PromptCache(cache_ram) if cache_ram else None
        self._spec = spec if spec is not None and spec.on else None
        self._draft_model = draft_model if self._spec is not None and self._spec.wants_model else None
        self._mtp = mtp if self._spec is not None and self._spec.wants_mtp else None
        #: what drafts for a slot that its n-grams give nothing: the draft model or the MTP head
        self._drafter: DraftModel | MtpHead | None = self._draft_model or self._mtp
        self._draft_cost = 0.0  # seconds the draft model takes per drafted token (_price_drafts)
        #: the acceptance of every slot's drafts, where a new sequence's starts: about the last hundred drafted tokens
        self._acceptance = Acceptance(decay=0.99)
        if self._spec is not None:
            s = self._spec
            pool = NgramPool(s.mod_match, s.mod_min, s.mod_max) if "ngram-mod" in s.kinds else None
            for slot in self._slots:
                slot.drafts = SeqDrafts(s, pool)
        #: recurrent layers (a state per sequence): a sequence is cut back only to roll back a rejected draft, into
        #: the per-token states its verification decode left (see _retire); its state cannot be shared either
        self._recurrent = bool(
            lc.llama_model_is_recurrent(llm._model.model) or lc.llama_model_is_hybrid(llm._model.model)
        )
        self._retire_seq = retire_seq if self._spec is not None and not self._recurrent else None
        self._retired = 0  # cells the retire sequence holds
        self._thread = threading.Thread(target=self._loop, name="llama-decode", daemon=True)
        self._thread.start()

    @property
    def n_parallel(self) -> int:
        return len(self._slots)

    def slots(self) -> list[dict[str, Any]]:
        """``/slots``: per slot whether it is serving, its prompt and cache, what it generated and may still."""
        out = []
        for slot in self._slots:
            busy = slot.seq is not None
            out.append(
                {
                    "id": slot.id,
                    "n_ctx": self.n_ctx,
                    "is_processing": busy,
                    "speculative": self._spec is not None,
                    "n_prompt_tokens_to_process": len(slot.pending) if busy else 0,
                    "n_past": slot.n_past,  # positions of the slot's cache filled (a prefix later prompts reuse)
                    "cache_tokens": len(slot.tokens),
                    "next_token": {
                        "has_next_token": busy,
                        "n_decoded": slot.n_gen if busy else 0,
                        "n_remain": max(0, slot.limit - slot.n_gen) if busy else 0,
                    },
                }
            )
        return out

    def submit(self, job: Job, run: Run, cancelled: Cancelled) -> Seq:
        """Queue ``job``; it joins the batch at the next step a slot is free."""
        seq = Seq(job, run, cancelled)
        with self._cond:
            if self._closed:
                raise RuntimeError("the model is unloading")
            self._waiting.append(seq)
            self._cond.notify()
        return seq

    def close(self) -> None:
        """Stop the decode thread (ending its sequences) and free the batch."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        self._lc.llama_batch_free(self._batch)
        if self._drafter is not None:
            self._drafter.close()

    def save_slot(self, slot_id: int, path: str) -> dict[str, Any]:
        """Write an idle slot's cached prompt (its tokens and K/V) to ``path`` (llama-server's ``action=save``)."""
        return self._control(lambda: self._save_file(self._idle(slot_id), path))

    def restore_slot(self, slot_id: int, path: str) -> dict[str, Any]:
        """Load a prompt :meth:`save_slot` wrote into an idle slot, which continues from it."""
        return self._control(lambda: self._load_file(self._idle(slot_id), path))

    def erase_slot(self, slot_id: int) -> dict[str, Any]:
        """Drop an idle slot's cached prompt."""

        def erase() -> dict[str, Any]:
            slot = self._idle(slot_id)
            n = len(slot.tokens)
            self._seq_rm(slot.id, 0)
            slot.tokens, slot.n_past, slot.reusable = [], 0, True
            return {"id_slot": slot.id, "n_erased": n}

        return self._control(erase)

    def _control(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` on the decode thread between two steps (the context is the decode thread's alone)."""
        done: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the model is unloading")
            self._controls.append((action, done))
            self._cond.notify()
        return done.result()

    # ------------------------------------------------------------------ decode thread

    def _idle(self, slot_id: int) -> _Slot:
        if not 0 <= slot_id < len(self._slots):
            raise InvalidArgument(f"id_slot must be from 0 to {len(self._slots) - 1}, got {slot_id}")
        slot = self._slots[slot_id]
        if slot.seq is not None:
            raise SlotBusy(f"slot {slot_id} is generating: save, restore or erase it when it is idle")
        return slot

    def _save_file(self, slot: _Slot, path: str) -> dict[str, Any]:
        if not slot.reusable:
            raise InvalidArgument(f"slot {slot.id} holds an image's positions, which a saved prompt cannot carry")
        start = time.perf_counter()
        tokens = (self._lc.llama_token * len(slot.tokens))(*slot.tokens)
        partial = f"{path}.partial"  # renamed once whole: a crash leaves no half-written state under the name
        written = self._lc.llama_state_seq_save_file(self._ctx, partial.encode(), slot.id, tokens, len(slot.tokens))
        if not written:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            raise RuntimeError(f"llama.cpp could not save slot {slot.id}")
        os.replace(partial, path)
        elapsed = (time.perf_counter() - start) * 1000
        n = len(slot.tokens)
        return {"id_slot": slot.id, "n_saved": n, "n_written": int(written), "timings": {"save_ms": elapsed}}

    def _load_file(self, slot: _Slot, path: str) -> dict[str, Any]:
        start = time.perf_counter()
        self._seq_rm(slot.id, 0)
        slot.tokens, slot.n_past, slot.reusable = [], 0, True
        tokens = (self._lc.llama_token * self.n_ctx)()
        count = ctypes.c_size_t(0)
        read = self._lc.llama_state_seq_load_file(
            self._ctx, path.encode(), slot.id, tokens, self.n_ctx, ctypes.byref(count)
        )
        if not read:
            self._seq_rm(slot.id, 0)
            raise InvalidArgument(f"{os.path.basename(path)} is not a saved prompt of this model and context")
        if self._spare is not None:
            self._compact_due = True  # its cells went where there was room: lay them out in order again
        slot.tokens = list(tokens[: count.value])
        slot.n_past = len(slot.tokens)
        elapsed = (time.perf_counter() - start) * 1000
        answer = {"id_slot": slot.id, "n_restored": slot.n_past, "n_read": int(read)}
        return {**answer, "timings": {"restore_ms": elapsed}}

    def _loop(self) -> None:
        if self._spare is not None:
            try:
                self.pads_single_rows = self._single_rows_differ()
            except RuntimeError:
                self.pads_single_rows = True  # padding never changes an answer, only its cost
        while True:
            if not self._order:  # no decode to send them with: the loop may wait now
                self._send()
            with self._cond:
                while not self._closed and not self._waiting and not self._order and not self._controls:
                    self._cond.wait()
                if self._closed:
                    break
                controls, self._controls = self._controls, deque()
                newcomers = self._take_newcomers()
            for action, done in controls:
                try:
                    done.set_result(action())
                except BaseException as exc:  # the caller's error, raised in its thread
                    done.set_exception(exc)
            try:
                for slot, seq in newcomers:
                    self._admit(slot, seq)
                if self._order:
                    self._step()
            except Exception as exc:  # a bug must fail its requests, not hang them
                self._send()
                for slot in list(self._order):
                    assert slot.seq is not None
                    slot.seq._events.put(exc)
                    self._seq_rm(slot.id, 0)
                    slot.tokens, slot.n_past = [], 0
                    self._release(slot)
        for slot in list(self._order):
            self._end(slot, End("cancelled"))
        self._send()
        for seq in self._waiting:
            seq._events.put(End("cancelled"))
        for _, done in self._controls:
            done.set_exception(RuntimeError("the model is unloading"))

    def _take_newcomers(self) -> list[tuple[_Slot, Seq]]:
        """Pair waiting requests with idle slots, each taking the idle slot that shares its longest prefix."""
        out: list[tuple[_Slot, Seq]] = []
        while self._waiting:
            seq = min(self._waiting, key=lambda s: s.job.priority)  # the first of the most urgent
            if seq.done or seq.cancelled():
                self._waiting.remove(seq)
                seq._events.put(End("cancelled"))
                continue
            idle = [s for s in self._slots if s.seq is None and all(s is not t for t, _ in out)]
            if not idle:
                break
            self._waiting.remove(seq)
            out.append((self._pick(idle, seq.job.tokens if not seq.job.images else []), seq))
        return out

    @staticmethod
    def _pick(idle: list[_Slot], tokens: list[int]) -> _Slot:
        """The idle slot sharing the longest prefix with ``tokens`` when that is a real share of the prompt (as
        llama-server's ``slot_prompt_similarity``), else the least recently used one (never used ones first): a
        two-token match is not worth another conversation's cache."""
        best = max(idle, key=lambda s: (common_prefix(s.tokens, tokens) if s.reusable else 0, -s.used))
        shared = common_prefix(best.tokens, tokens) if best.reusable else 0
        if shared > 0 and shared >= SIMILARITY * len(tokens):
            return best
        return min(idle, key=lambda s: s.used)

    def _admit(self, slot: _Slot, seq: Seq) -> None:
        job, run = seq.job, seq.run
        slot.t_admit = slot.used = time.perf_counter()
        try:
            slot.sampler = SeqSampler(
                self._llm, job.sampling, job.seed, job.grammar, self._is_eog, job.logit_bias, job.budget
            )
        except BaseException as exc:
            seq._events.put(exc)
            return
        slot.seq = seq
        slot.n_gen = 0
        slot.idx = -1
        self._order.append(slot)
        if job.images:
            self._admit_vision(slot, seq)
            return
        tokens = job.tokens
        # Without batch-invariant kernels ggml rounds a prompt evaluated in one batch and its last token evaluated
        # alone differently: a request that must repeat an earlier answer there asks for the whole prompt
        # (cache_prompt: false, llama-server's field)
        prefix = common_prefix(slot.tokens, tokens) if slot.reusable and job.cache_prompt else 0
        if self.cache is not None and job.cache_prompt:
            prefix = self._from_ram(slot, tokens, prefix)
        if job.cache_prompt:
            prefix = self._from_neighbour(slot, tokens, prefix)
        reuse = min(prefix, len(tokens) - 1)  # at least one token is evaluated, for fresh logits
        if not (reuse > 0 and self._window_intact(slot.id, reuse) and self._seq_rm(slot.id, reuse)):
            reuse = 0
            self._seq_rm(slot.id, 0)
        slot.tokens = tokens[:reuse]
        slot.reusable = True
        if slot.drafts is not None:
            slot.drafts.reset(tokens, self._acceptance.rate)
        slot.n_past = reuse
        slot.pending = tokens[reuse:]
        slot.last = -1
        slot.limit = self._limit(job.max_tokens, len(tokens))
        slot.follow = self._leader(slot, tokens, reuse) if job.cache_prompt else None
        run.cached = reuse
        run.prompt_tokens = len(tokens)

    def _leader(self, slot: _Slot, tokens: list[int], held: int) -> tuple[_Slot, Seq, int] | None:
        """Another slot whose prompt, still being evaluated, will hold a longer prefix of ``tokens`` than the
        ``held`` tokens ``slot`` holds, by :data:`MIN_SHARED` or more: ``slot`` waits for it to get there and shares
        its cells then (:meth:`_from_neighbour`), instead of evaluating the same tokens beside it. Only a leader as
        urgent or more (a less urgent prompt takes few tokens a step while others generate)."""
        if self._recurrent or self._mtp is not None:
            return None
        assert slot.seq is not None
        best: tuple[_Slot, Seq, int] | None = None
        for other in self._slots:
            seq = other.seq
            if other is slot or seq is None or other.last >= 0 or not other.pending or not other.reusable:
                continue
            if seq.job.images or seq.job.priority > slot.seq.job.priority:
                continue
            n = min(common_prefix(other.tokens + other.pending, tokens), len(tokens) - 1)
            if best is None or n > best[2] or (n == best[2] and best[0].follow is not None):
                best = (other, seq, n)
        if best is None or best[2] < max(held + MIN_SHARED, SIMILARITY * len(tokens)):
            return None
        return best

    def _catch_up(self) -> None:
        """Followers whose leader got far enough (or went away) take their shared prefix and go on alone."""
        for slot in self._order:
            if slot.follow is None:
                continue
            leader, seq, shared = slot.follow
            if leader.seq is seq and not seq.done and len(leader.tokens) < shared:
                continue  # not there yet
            slot.follow = None
            assert slot.seq is not None
            tokens, held = slot.seq.job.tokens, slot.n_past
            if self._from_neighbour(slot, tokens, held) > held:
                slot.pending = tokens[slot.n_past :]
                slot.seq.run.cached = slot.n_past

    def _from_ram(self, slot: _Slot, tokens: list[int], prefix: int) -> int:
        """Before ``slot``'s cache is cut back to ``prefix`` tokens of ``tokens``: save it to the RAM cache, and
        restore the saved prompt sharing more with ``tokens``, if there is one; returns the prefix the slot holds."""
        assert self.cache is not None
        entry, shared = self.cache.best(tokens)
        better = entry is not None and shared > prefix and shared >= SIMILARITY * len(tokens)
        # a turn that keeps most of the slot (a conversation going on) is not worth a copy of its whole state
        if better or 2 * prefix < len(slot.tokens):
            self._save(slot)
        if not better or entry is None:
            return prefix
        self._seq_rm(slot.id, 0)
        slot.tokens, slot.n_past = [], 0
        self.cache.take(entry)
        if self._lc.llama_state_seq_set_data(self._ctx, entry.state, entry.size, slot.id) != entry.size:
            self._seq_rm(slot.id, 0)  # no room for it: the prompt is evaluated whole
            return 0
        if self._spare is not None:
            self._compact_due = True  # its cells went where there was room: lay them out in order again
        slot.tokens = entry.tokens
        return shared

    def _from_neighbour(self, slot: _Slot, tokens: list[int], prefix: int) -> int:
        """When another slot (generating or idle) holds a longer prefix of ``tokens`` than ``slot`` does, share
        its cells for that prefix with ``slot`` (``llama_memory_seq_cp``: the cells gain a sequence, nothing is
        computed or copied): rows of one template evaluate its instruction once, not once per slot. Returns the
        prefix ``slot`` holds.

        Its K/V are what ``slot`` would compute for the same tokens at the same positions (batch-invariant kernels:
        the same bits however they were batched), so the answer does not change. Not for recurrent models (a
        state, not cells per position), an MTP head (it mirrors each slot's cache) or a donor serving images.
        """
        if self._recurrent or self._mtp is not None:
            return prefix
        best, shared = None, prefix
        for other in self._slots:
            if other is slot or not other.reusable or (other.seq is not None and other.seq.job.images):
                continue
            n = common_prefix(other.tokens, tokens)
            if n > shared:
                best, shared = other, n
        if best is None or shared < max(MIN_SHARED, SIMILARITY * len(tokens)):
            return prefix
        shared = min(shared, len(tokens) - 1)  # at least one token is evaluated, for fresh logits
        if shared <= prefix or not self._window_intact(best.id, shared):
            return prefix
        self._seq_rm(slot.id, 0)
        self._lc.llama_memory_seq_cp(self._mem, best.id, slot.id, 0, shared)
        slot.tokens, slot.n_past = tokens[:shared], shared
        return shared

    def _save(self, slot: _Slot) -> None:
        """Copy ``slot``'s sequence state into the RAM cache (unless it holds no tokens or it is there already)."""
        assert self.cache is not None
        lc = self._lc
        if not slot.reusable or not slot.tokens or self.cache.holds(slot.tokens):
            return
        if lc.llama_memory_seq_pos_max(self._mem, slot.id) < 0:
            return
        size = lc.llama_state_seq_get_size(self._ctx, slot.id)
        buf = (ctypes.c_uint8 * size)()
        n = lc.llama_state_seq_get_data(self._ctx, buf, size, slot.id)
        if n:
            self.cache.add(slot.tokens, buf, n)

    def _admit_vision(self, slot: _Slot, seq: Seq) -> None:
        """Evaluate a prompt with images at once (mtmd drives its own decodes), then sample its first token."""
        assert self._vision is not None  # images are refused at the request without one
        self._seq_rm(slot.id, 0)
        slot.tokens, slot.reusable, slot.pending = [], False, []
        if slot.drafts is not None:
            # image positions hold no tokens: n-gram drafts come from the output alone
            slot.drafts.reset([], self._acceptance.rate)
        try:
            if self._compact_due:  # mtmd decodes the images itself, not through _decode
                self._compact()
            self._use_threads(self._threads)
            decode = self._decode_text(slot)
            n_past = self._vision.prefill(seq.job.prompt, seq.job.images, seq=slot.id, decode_text=decode)
        except BaseException as exc:
            self._seq_rm(slot.id, 0)
            self._release(slot)
            seq._events.put(exc)
            return
        slot.n_past = n_past
        slot.limit = self._limit(seq.job.max_tokens, n_past)
        seq.run.cached, seq.run.prompt_tokens = 0, n_past
        seq.prefilled_at = time.perf_counter()
        seq.run.prompt_ms = (seq.prefilled_at - slot.t_admit) * 1000.0
        slot.idx = -1  # the last decode's last row
        self._sample(slot)

    def _decode_text(self, slot: _Slot) -> Callable[[list[int], int], None]:
        def decode(tokens: list[int], pos: int) -> None:
            for i in range(0, len(tokens), self._n_batch):
                part = tokens[i : i + self._n_batch]
                n = len(part)
                self._fill(0, part, pos + i, slot.id)
                self._logits[:n] = 0
                self._logits[n - 1] = 1
                rc = self._decode(n)
                if rc != 0:
                    raise RuntimeError(f"llama_decode failed ({rc}) on a prompt with images")

        return decode

    def _limit(self, max_tokens: int, n_prompt: int) -> int:
        room = self.n_ctx - n_prompt
        return room if max_tokens < 0 else min(max_tokens, room)

    def _step(self) -> None:
        """Decode one batch: each generating slot's last token, then prompt chunks; sample every slot that is due."""
        for slot in list(self._order):
            seq = slot.seq
            assert seq is not None
            if seq.done or seq.cancelled():
                self._end(slot, End("cancelled"))
        if not self._order:
            return
        self._catch_up()
        # a more urgent request's prompt is evaluated in a step of the most urgent requests alone (it answers as
        # soon as it would on an idle model); while one generates, a less urgent prompt takes at most
        # BEHIND_PREFILL tokens a step, so its steps stay short
        urgent = min(_priority(slot) for slot in self._order)
        mixed = any(_priority(slot) > urgent for slot in self._order)
        alone = mixed and any(s.last < 0 and s.pending and _priority(s) == urgent for s in self._order)
        generating = [slot for slot in self._order if slot.last >= 0 and not (alone and _priority(slot) > urgent)]
        drafted = self._spec is not None and self._draft(generating)
        prompts = any(slot.last < 0 and slot.pending for slot in self._order)
        if not (prompts and generating):
            self._prefill_saved = 0.0
        if generating and not drafted and not prompts:
            self._generate(generating)
            return
        planned: list[tuple[_Slot, list[int]]] = [(slot, [slot.last, *slot.draft]) for slot in generating]
        rows = sum(len(rows) for _, rows in planned)
        room = self._n_batch - rows
        # the shortest prompt first (a question sent while a pasted paper is evaluated answers at once), within
        # the order of priority
        filling = sorted(
            (s for s in self._order if s.last < 0 and s.pending), key=lambda s: (_priority(s), len(s.pending))
        )
        if rows:  # decoding goes first: the prompts get the budget's tokens of this step
            longest = max((len(s.pending) for s in filling if s.follow is None), default=0)
            room = min(room, self._prefill_room(rows, longest))
        behind = 0 if alone else BEHIND_PREFILL
        for slot in filling:
            if slot.follow is not None:
                continue  # its leader evaluates what they share first
            later = _priority(slot) > urgent
            chunk = slot.pending[: min(room, behind) if later else room]
            if not chunk:
                if later:
                    break
                continue
            planned.append((slot, chunk))
            room -= len(chunk)
            if later:
                behind -= len(chunk)
        for part in self._parts(planned) if drafted and self._recurrent else [planned]:
            part = [(slot, rows) for slot, rows in part if slot.seq is not None]  # an earlier part may end some
            if not part:
                continue
            n = self._lay(part)
            # a decode of generating rows and drafts only prices drafts (draft_length) by its rows. It runs on -tb:
            # trying thread counts for each size a draft makes would cost more than it could find.
            priced = all(slot.last >= 0 for slot, _ in part)
            prompt_rows = sum(len(rows) for slot, rows in part if slot.last < 0)
            self._short = False
            if not self._run(part, n):
                return
            if priced and not self._short:
                self.costs.price(n, self._decode_s)
            elif prompt_rows and not self._short:
                self._price_prompt(n - prompt_rows, prompt_rows)

    def _prefill_room(self, rows: int, longest: int) -> int:
        """The prompt tokens a step of ``rows`` generating rows takes besides, the longest prompt waiting having
        ``longest`` tokens left: ``--prefill-budget``, or what :meth:`_measured_room` allows, saved up over steps
        without prompt tokens until it reaches :data:`PREFILL_CHUNK` (or the longest prompt's rest)."""
        if self._prefill_budget is not None:
            return self._prefill_budget
        room = self._measured_room(rows)
        chunk = min(PREFILL_CHUNK, longest, self._n_batch - rows)
        if room == 0 or room >= chunk:
            return room
        self._prefill_saved += room
        if self._prefill_saved < chunk:
            return 0
        room, self._prefill_saved = int(self._prefill_saved), 0.0
        return room

    def _measured_room(self, rows: int) -> int:
        """The prompt tokens whose measured cost fits in the time the ``rows`` generating rows' own decode measured
        (the step then takes about twice a generating step: the streams keep about half their rate). Until that
        decode was measured, one step in :data:`_MEASURE_EVERY` has no prompt tokens, so that it is (a decode
        that got fewer cores than it asked for is not measured), and the others take :data:`FIRST_PREFILL`."""
        decode = self.costs.curve(rows)[rows]
        if decode is None:
            self._unmeasured += 1
            return 0 if self._unmeasured % _MEASURE_EVERY == 1 else FIRST_PREFILL
        if self._prompt_cost is None:
            return FIRST_PREFILL
        if decode >= self._prompt_cost * self._n_batch:  # also a prompt token measured to add nothing
            return self._n_batch
        return max(1, int(decode / self._prompt_cost))

    def _price_prompt(self, rows: int, prompt_rows: int) -> None:
        """A decode of ``rows`` generating rows and ``prompt_rows`` prompt tokens took ``self._decode_s``: what a
        prompt token adds (the generating rows' part as :meth:`StepCosts.curve` expects it)."""
        decode = self.costs.curve(rows)[rows] if rows else 0.0
        if decode is None:
            return
        cost = max(0.0, self._decode_s - decode) / prompt_rows
        last = self._prompt_cost
        self._prompt_cost = cost if last is None else last + _COST_WEIGHT * (cost - last)

    def _lay(self, part: list[tuple[_Slot, list[int]]]) -> int:
        """Fill the batch from row 0 with ``part``; how many rows it took. Every row of a generating slot gives
        logits (its draft is checked row by row against the sampler); of a prompt's chunk, only the last row of
        the prompt does."""
        n = 0
        for slot, rows in part:
            self._fill(n, rows, slot.n_past, slot.id)
            if slot.last >= 0:
                self._logits[n : n + len(rows)] = 1
                slot.idx = n
            else:
                self._logits[n : n + len(rows)] = 0
                slot.idx = n + len(rows) - 1 if len(rows) == len(slot.pending) else -1
                if slot.idx >= 0:
                    self._logits[slot.idx] = 1
            n += len(rows)
        return n

    def _parts(self, planned: list[tuple[_Slot, list[int]]]) -> list[list[tuple[_Slot, list[int]]]]:
        """The decodes a recurrent model's step with drafts takes: the rows without a draft, then the drafted slots
        in groups of one length, each group within one ubatch.

        llama.cpp rolls a recurrent state back from the states it kept for each token of the sequence's last
        ubatch, where that ubatch left them. A later ubatch of the same ``llama_decode`` may move the sequence's
        state to another cell (it gathers its own sequences' states into adjacent cells), taking the current
        state along but not the kept ones, and the rollback after the decode would read another cell's. Once the
        rollback is pending, a move takes the rolled-back state, so each group is verified, and its rejected
        drafts dropped, before the next decode. llama.cpp would split these rows into much the same ubatches (a
        ubatch holds as many tokens of each of its sequences); what it adds is a compaction before each group
        after the first that follows a rejection, where the cells are compacted (batch-invariant kernels).
        """
        rest = [(slot, rows) for slot, rows in planned if not slot.draft]
        groups: dict[int, list[tuple[_Slot, list[int]]]] = {}
        for slot, rows in planned:
            if slot.draft:
                groups.setdefault(len(rows), []).append((slot, rows))
        limit = int(self._lc.llama_n_ubatch(self._ctx))
        parts = [rest] if rest else []
        for size, group in sorted(groups.items()):
            per = max(1, limit // size)
            parts += [group[i : i + per] for i in range(0, len(group), per)]
        return parts

    def _generate(self, slots: list[_Slot]) -> None:
        """A step of generating slots only: one decode or several, on as many threads as measured fastest
        (StepCosts)."""
        plan = self.costs.plan(len(slots))
        started = time.perf_counter()
        self._short = False
        start = 0
        for size in plan.parts:
            group = [slot for slot in slots[start : start + size] if slot.seq is not None]
            start += size
            for n, slot in enumerate(group):
                self._fill(n, [slot.last], slot.n_past, slot.id)
                self._logits[n] = 1
                slot.idx = n
            if group and not self._run([(slot, [slot.last]) for slot in group], len(group), plan.threads):
                return
            if group and not self._short and plan.threads == self._threads[1]:
                self.costs.price(len(group), self._decode_s)
        if not self._short:
            self.costs.record(plan, time.perf_counter() - started)

    def _run(self, planned: list[tuple[_Slot, list[int]]], n: int, threads: int | None = None) -> bool:
        """Decode the first ``n`` rows of the batch, holding ``planned``, and sample every slot that is due.

        Returns:
            Whether the decode went through (if not, room was made for the next step).
        """
        rc = self._decode(n, threads)
        if rc != 0:
            for slot, _ in planned:
                self._seq_rm(slot.id, slot.n_past)  # a failed decode may leave part of a batch behind
                slot.idx = -1
            self._make_room(rc)
            return False
        now = time.perf_counter()
        before = [slot.n_past for slot, _ in planned]
        for slot, part in planned:
            if slot.draft:
                self._verify(slot, part)
                continue
            slot.tokens.extend(part)
            slot.n_past += len(part)
            if slot.last < 0:
                del slot.pending[: len(part)]
                if slot.pending:
                    continue
                assert slot.seq is not None
                slot.seq.prefilled_at = now
                slot.seq.run.prompt_ms = (now - slot.t_admit) * 1000.0
            self._sample(slot)
        if self._mtp is not None:
            self._mirror(planned, before)
        return True

    def _mirror(self, planned: list[tuple[_Slot, list[int]]], before: list[int]) -> None:
        """Hand the MTP head what each text slot of the decode kept (its rows lie in ``planned``'s order from row 0),
        before the next decode overwrites the target's hidden states."""
        assert self._mtp is not None
        kept, row = [], 0
        for (slot, part), n_past in zip(planned, before, strict=True):
            n = slot.n_past - n_past
            if slot.reusable and n > 0:
                kept.append((slot.id, n_past, slot.tokens[n_past : n_past + n], row))
            row += len(part)
        self._mtp.mirror(kept)

    def _draft(self, generating: list[_Slot]) -> bool:
        """Give each generating slot that drafts this step a draft, within the batch's rows, the tokens the slot may
        still generate and its context: its n-gram draft, else the draft model's (one decode for all such slots);
        a grammar's slot keeps the part its grammar allows. Each is cut to the length that yields the most tokens
        per second by the slot's acceptance and what steps of each size measured (drafts.draft_length), slot by
        slot with the rows before it counted, never below ``--spec-draft-n-min``. Whether any slot got one."""
        assert self._spec is not None
        room = self._n_batch - len(generating)
        floor = max(1, self._spec.draft_min)
        pin = self._spec.draft_min  # --spec-draft-n-min: no draft is cut below it, however little it pays
        cost = self.costs.curve(self._n_batch)
        rows, tokens = len(generating), float(len(generating))
        asks: list[tuple[_Slot, int]] = []
        for slot in generating:
            slot.draft = []
            drafts = slot.drafts
            fits = min(room, slot.limit - slot.n_gen - 1, self.n_ctx - slot.n_past - 2)
            n = drafts.pacer.room(fits) if drafts is not None and fits > 0 else 0
            if n < floor or drafts is None:
                continue
            draft = self._allowed(slot, drafts.lookup(n))
            acceptance = drafts.pacer.acceptance
            if len(draft) >= floor:
                k = max(pin, draft_length(acceptance, len(draft), rows, tokens, cost))
                slot.draft = draft[:k] if k >= floor else []
            elif not draft and self._drafter is not None and slot.reusable:
                n = min(n, self._spec.draft_max)  # the drafter's context holds that many per slot
                k = max(pin, draft_length(acceptance, n, rows, tokens, cost, self._draft_cost))
                if k >= floor:
                    asks.append((slot, k))
            else:
                continue
            if k < floor:
                drafts.pacer.skipped(self._acceptance.rate)
                continue
            rows, tokens, room = rows + k, tokens + expected(acceptance, k), room - k
        if asks:
            wants = [(slot.id, [*slot.tokens, slot.last], n) for slot, n in asks]
            started = time.perf_counter()
            answers = self._drafter.draft(wants, self._spec.p_min) if self._drafter is not None else []
            self._price_drafts(time.perf_counter() - started, max(n for _, n in asks))
            for (slot, _), draft in zip(asks, answers, strict=True):
                draft = self._allowed(slot, draft)
                slot.draft = draft if len(draft) >= floor else []
        return any(slot.draft for slot in generating)

    def _allowed(self, slot: _Slot, draft: list[int]) -> list[int]:
        """The part of ``draft`` a grammar's slot may decode (the whole draft for other slots)."""
        if draft and slot.sampler is not None and slot.sampler.constrained:
            return draft[: slot.sampler.allowed(draft)]
        return draft

    def _price_drafts(self, seconds: float, longest: int) -> None:
        """A draft model's decodes took ``seconds`` for drafts of up to ``longest`` tokens: what drafting one more
        token costs, a running mean of its recent drafts."""
        per_token = seconds / max(1, longest)
        self._draft_cost = per_token if self._draft_cost == 0.0 else 0.75 * self._draft_cost + 0.25 * per_token

    def _verify(self, slot: _Slot, rows: list[int]) -> None:
        """Sample ``slot`` row by row through its draft, keeping each drafted token its sampler picks as well.

        Row ``i``'s logits are those the sequence would have had after the first ``i`` draft tokens, and the
        sampler (its seed's random state, penalties, grammar) advances by exactly the tokens it picks, so the
        tokens are those decoding one at a time gives, greedy or sampled: the first disagreement is the token it
        would have sampled there, and the draft after it is dropped.
        """
        draft, slot.draft = slot.draft, []
        seq, drafts, base = slot.seq, slot.drafts, slot.idx
        assert seq is not None and drafts is not None
        slot.tokens.append(rows[0])
        slot.n_past += 1
        accepted = 0
        for i in range(len(draft) + 1):
            slot.idx = base + i
            token = self._sample(slot)
            if slot.seq is None or i == len(draft) or token != draft[i]:
                break
            slot.tokens.append(token)  # its K/V is already in the cache: the decode computed it
            slot.n_past += 1
            accepted += 1
        if accepted < len(draft) and not self._retire(slot.id, slot.n_past):
            slot.reusable = False  # its cache holds the rejected draft: the next prompt is evaluated whole
            if slot.seq is not None:
                self._outbox.append((seq, RuntimeError("llama.cpp could not roll back a recurrent state")))
                self._end(slot, None)
        seq.run.drafted += len(draft)
        seq.run.accepted += accepted
        drafts.record(len(draft), accepted)
        self._acceptance.record(len(draft), accepted)

    def _retire(self, seq_id: int, start: int) -> bool:
        """Drop positions ``start`` onwards of a sequence after a rejected draft; whether that went through.

        With batch-invariant kernels no cell below another sequence's may be freed (see :meth:`_compact`), and
        these cells lie below the cells later rows of the same step took: the retire sequence takes them over
        instead, leaving them occupied (a sequence attends only to its own cells, so they change nothing). They
        are freed all at once, with a compaction, when they fill an eighth of the context or the cache is full.

        A recurrent model's sequence rolls back into the state llama.cpp kept for that token of the verification
        decode (the engine bounds drafts by how many it keeps); its state cannot be shared with a retire sequence,
        so the cells are freed and, with batch-invariant kernels, the cache compacted before the next decode.
        """
        lc = self._lc
        if self._recurrent:
            if self._spare is not None:
                self._compact_due = True
            return bool(lc.llama_memory_seq_rm(self._mem, seq_id, start, -1))
        if self._retire_seq is not None:
            self._retired += max(0, int(lc.llama_memory_seq_pos_max(self._mem, seq_id)) - start + 1)
            lc.llama_memory_seq_cp(self._mem, seq_id, self._retire_seq, start, -1)
        lc.llama_memory_seq_rm(self._mem, seq_id, start, -1)
        if self._retired > self.n_ctx // 8:
            self._free_retired()
        return True

    def _free_retired(self) -> None:
        assert self._retire_seq is not None
        self._lc.llama_memory_seq_rm(self._mem, self._retire_seq, -1, -1)
        self._retired = 0
        self._compact_due = True

    def _sample(self, slot: _Slot) -> int | None:
        """Sample ``slot`` from its logits row and hand the token over; the token, or None if sampling failed."""
        seq, sampler = slot.seq, slot.sampler
        assert seq is not None and sampler is not None
        try:
            token = sampler.sample(self._ctx, slot.idx)
            n_probs = seq.job.n_probs
            lp = sampler.logprob(self._ctx, slot.idx, token, n_probs) if n_probs is not None else None
        except BaseException as exc:
            self._outbox.append((seq, exc))
            self._end(slot, None)
            return None
        self._outbox.append((seq, (token, lp)))
        seq.run.decode_threads = self._used
        slot.n_gen += 1
        slot.last = token
        if slot.drafts is not None:
            slot.drafts.extend([token])
        if self._is_eog(token):
            self._end(slot, None)  # the reader stops at the end token
        elif slot.n_gen >= slot.limit or slot.n_past >= self.n_ctx:
            self._end(slot, End("length"))
        return token

    def _make_room(self, rc: int) -> None:
        """After a failed decode: free idle slots' caches, else end the newest sequence ("length")."""
        if rc == 1:  # no room in the KV cache for this batch
            if self._retired:
                self._free_retired()
                return
            idle = [s for s in self._slots if s.seq is None and s.n_past > 0]
            for slot in idle:
                if self.cache is not None:
                    self._save(slot)
                self._seq_rm(slot.id, 0)
                slot.tokens, slot.n_past = [], 0
            if idle:
                return
            self._end(self._order[-1], End("length"))
            return
        error = RuntimeError(f"llama_decode failed (code {rc})")
        for slot in list(self._order):
            assert slot.seq is not None
            self._outbox.append((slot.seq, error))
            self._end(slot, None)

    def _end(self, slot: _Slot, end: End | None) -> None:
        """Free ``slot``; its cache stays for the next prompt that shares a prefix."""
        seq = slot.seq
        if seq is not None and end is not None:
            self._outbox.append((seq, end))
        if not slot.reusable:
            self._seq_rm(slot.id, 0)
            slot.tokens, slot.n_past = [], 0
        self._release(slot)

    def _release(self, slot: _Slot) -> None:
        if slot.sampler is not None:
            slot.sampler.close()
        slot.seq, slot.sampler, slot.pending, slot.last, slot.idx, slot.follow = None, None, [], -1, -1, None
        if slot in self._order:
            self._order.remove(slot)

    # ------------------------------------------------------------------ llama.cpp calls

    def _send(self) -> None:
        """Hand the results of the last step to their readers. Done as the next decode starts, which releases the
        GIL for its whole length: readers woken earlier would hold the decode thread back while they work."""
        for seq, item in self._outbox:
            seq._events.put(item)
        self._outbox.clear()

    def _fill(self, start: int, tokens: list[int], pos: int, seq_id: int) -> None:
        n = len(tokens)
        self._tok[start : start + n] = tokens
        self._pos[start : start + n] = range(pos, pos + n)
        seq_ids = self._batch.seq_id
        for i in range(start, start + n):
            seq_ids[i][0] = seq_id

    def _decode(self, n: int, threads: int | None = None) -> int:
        """Decode the first ``n`` rows of the batch, padded to two rows and two outputs when the model needs it, on
        ``threads`` (a generation step's plan) or on ``-t``/``-tb``, as far as the CPU turns give the cores."""
        if self._compact_due:
            self._compact()
        padded = self.pads_single_rows and (n < 2 or int(self._logits[:n].sum()) == 1)
        if padded:
            assert self._spare is not None
            self._fill(n, [0], 0, self._spare)
            self._logits[n] = 1
            n += 1
        self._batch.n_tokens = n
        self._send()  # the readers turn the last step's tokens into text while this one computes
        rc = self._on_cores((threads, threads) if threads is not None else self._threads)
        if padded:
            assert self._spare is not None
            self._lc.llama_memory_seq_rm(self._mem, self._spare, -1, -1)  # the top cell: leaves no hole
        return rc

    def _on_cores(self, threads: tuple[int, int]) -> int:
        """``llama_decode`` of the batch as it stands, on ``threads`` (one-token, batch) or as many cores as its turn
        gives."""
        with on_cores(self._turn, threads) as given:
            self._short = self._short or given != threads
            self._use_threads(given)
            self._used = given[0] if self._batch.n_tokens == 1 else given[1]
            started = time.perf_counter()
            rc = int(self._lc.llama_decode(self._ctx, self._batch))
            self._decode_s = time.perf_counter() - started
            return rc

    def _use_threads(self, threads: tuple[int, int]) -> None:
        if threads != self._threads_set:
            self._lc.llama_set_n_threads(self._ctx, *threads)
            self._threads_set = threads

    def _compact(self) -> None:
        """Lay every sequence's cells out again contiguously, before anything is placed in the cells a removal freed.

        Attention visits a unified cache's cells in index order, and llama.cpp fills freed cells first, so after a
        removal a sequence's next cells could land below its earlier ones and its attention would sum in another
        order than alone. Saving each sequence, clearing the cache and restoring them one after another (llama.cpp
        restores a sequence's cells in their order, from the cache's head) leaves no free cell below any sequence;
        new cells then go above, and every sequence stays in position order.
        """
        lc = self._lc
        self._compact_due = False
        self._retired = 0  # clearing the cache frees them
        saved = []
        for slot in self._slots:
            if lc.llama_memory_seq_pos_max(self._mem, slot.id) < 0:
                continue
            size = lc.llama_state_seq_get_size(self._ctx, slot.id)
            buf = (ctypes.c_uint8 * size)()
            n = lc.llama_state_seq_get_data(self._ctx, buf, size, slot.id)
            saved.append((slot.id, buf, n))
        lc.llama_memory_clear(self._mem, False)
        for seq_id, buf, n in saved:
            if lc.llama_state_seq_set_data(self._ctx, buf, n, seq_id) != n:
                raise RuntimeError(f"llama.cpp could not restore sequence {seq_id} while compacting its cache")

    def _single_rows_differ(self) -> bool:
        """Whether a row decoded alone gets other logits than the same row beside another (float weights do:
        llamafile's sgemm takes two rows or more, ggml's vec_dot one)."""
        import numpy as np

        assert self._spare is not None
        n_vocab = self._llm.n_vocab()
        rows = []
        for seqs in ((self._spare,), (self._spare, 0)):
            for i, seq in enumerate(seqs):
                self._fill(i, [0], 0, seq)
                self._logits[i] = 1
            self._batch.n_tokens = len(seqs)
            rc = self._on_cores(self._threads)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc}) on a one-token probe")
            logits = self._lc.llama_get_logits_ith(self._ctx, 0)
            rows.append(np.ctypeslib.as_array(logits, shape=(n_vocab,)).copy())
            for seq in seqs:
                self._lc.llama_memory_seq_rm(self._mem, seq, -1, -1)
        return not np.array_equal(rows[0], rows[1])

    def _seq_rm(self, seq_id: int, start: int) -> bool:
        """Drop positions ``start`` onwards of a sequence (0: all of it); whether it went through.

        A recurrent model's sequence is not cut back here (only after a draft, :meth:`_retire`): llama.cpp would
        roll it back into whatever state it kept that many tokens back, which only a decode of that many tokens
        just before leaves right.
        """
        lc = self._lc
        if self._recurrent and 0 < start <= lc.llama_memory_seq_pos_max(self._mem, seq_id):
            return False
        if self._spare is not None and lc.llama_memory_seq_pos_max(self._mem, seq_id) >= start:
            self._compact_due = True
        if self._mtp is not None and seq_id < len(self._slots):
            self._mtp.forget(seq_id, start)
        return bool(lc.llama_memory_seq_rm(self._mem, seq_id, start if start > 0 else -1, -1))

    def _window_intact(self, seq_id: int, n_past: int) -> bool:
        """Whether the sequence still holds every cell a prompt continued at ``n_past`` attends to.

        A sliding-window cache that is not full size (``swa_full`` off) drops the cells older than its window:
        continuing from a prefix whose window was dropped would silently change the output, so then the whole
        prompt is evaluated again (llama-server's rule). Full-size and ordinary caches keep position 0 onwards.
        """
        pos_min = int(self._lc.llama_memory_seq_pos_min(self._mem, seq_id))
        return pos_min <= max(0, n_past - max(1, self._n_swa))

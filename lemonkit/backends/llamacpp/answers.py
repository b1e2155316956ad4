"""OpenAI response shapes built from generated tokens: ids, usage and timings, finish reasons, logprobs, chat
deltas (content / reasoning / tool calls), whole messages and streamed chunks, for chat and text completions.

Everything here consumes the ``(text, logprob)`` pairs a :class:`~lemonkit.backends.llamacpp.generation.Generator`
yields and touches no model.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from lemonkit.backends.chat import ForcedToolStream, ToolSpec, make_parser, new_call_id
from lemonkit.backends.chat.tool_formats import ChatFormat
from lemonkit.backends.llamacpp.interleave import interleave
from lemonkit.backends.protocol import Cancelled

if TYPE_CHECKING:
    from lemonkit.backends.llamacpp.jobs import Job, Logprob

__all__ = [
    "ChatPlan",
    "Run",
    "chat_choices",
    "chat_deltas",
    "chat_message",
    "chat_stream",
    "completion",
    "completion_chunks",
    "completion_id",
]

T = TypeVar("T")

#: ``(text, logprob)`` per generated token, as the generator yields them
Tokens = Iterator[tuple[str, "Logprob | None"]]
#: a chat delta and the logprobs of the tokens behind it
Delta = tuple[dict[str, Any], list[dict[str, Any]] | None]
TokenBytes = Callable[[int], bytes]


@dataclass
class Run:
    """What one generation measured (filled in as it runs)."""

    t_start: float
    finish_reason: str = "length"
    prompt_tokens: int = 0
    cached: int = 0
    generated: int = 0
    prompt_ms: float = 0.0
    ttft: float = 0.0
    times: list[float] = field(default_factory=list)
    decode_threads: int = 0  # of the decode that gave the last token: fewer than -t when cores were taken
    #: the stop string that ended it (its choice's ``stop_sequence``, which Anthropic's ``stop_sequence`` reads)
    stop_word: str | None = None
    drafted: int = 0  # speculative decoding: draft tokens decoded
    accepted: int = 0  # and those the sampler agreed with

    def timings(self) -> dict[str, Any]:
        """llama-server's ``timings`` object."""
        prompt_n = self.prompt_tokens - self.cached
        predicted_ms = sum(self.times) * 1000.0
        n = self.generated
        return {
            "cache_n": self.cached,
            "prompt_n": prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n * 1000.0 / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / n if n else 0.0,
            "predicted_per_second": n * 1000.0 / predicted_ms if predicted_ms > 0 else 0.0,
            # llama-server's, present when the model speculates
            **({"draft_n": self.drafted, "draft_n_accepted": self.accepted} if self.drafted else {}),
        }

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generated,
            "total_tokens": self.prompt_tokens + self.generated,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }

    def stopped_by(self) -> dict[str, str]:
        """``{"stop_sequence": s}`` when a stop string ``s`` ended the text, else nothing."""
        return {"stop_sequence": self.stop_word} if self.stop_word is not None else {}

    @property
    def finish(self) -> str:
        """The OpenAI ``finish_reason`` (a cancelled run that is still reported stopped)."""
        return "stop" if self.finish_reason == "cancelled" else self.finish_reason


#: generates one job's tokens, filling its run, until it ends or the cancellation says so
Generate = Callable[["Job", Run, Cancelled], Tokens]


def _add_usage(runs: list[Run]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Usage and timings summed over the runs of a multi-prompt completion."""
    if len(runs) == 1:
        return runs[0].usage(), runs[0].timings()
    total = Run(t_start=runs[0].t_start)
    for r in runs:
        total.prompt_tokens += r.prompt_tokens
        total.cached += r.cached
        total.generated += r.generated
        total.prompt_ms += r.prompt_ms
        total.times.extend(r.times)
        total.drafted += r.drafted
        total.accepted += r.accepted
    return total.usage(), total.timings()


def completion_id(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(24).replace("-", "x").replace("_", "y")[:32]


# ----------------------------------------------------------------------------- chat


@dataclass
class ChatPlan:
    """How to turn the generated text of a chat request into a message."""

    mode: str  # "plain" | "auto" (parse tool calls) | "forced" (grammar-constrained call) | "json" (response_format)
    tools: ToolSpec | None
    in_reasoning: bool
    fmt: ChatFormat | None = None  # the model family's markup (None: Hermes)
    parallel: bool = True  # parallel_tool_calls: False ends the answer when a second call would start


def _chat_logprob(lp: Logprob, token_bytes: TokenBytes) -> dict[str, Any]:
    _, raw, value, tops = lp
    return {
        "token": raw.decode("utf-8", "replace"),
        "logprob": value,
        "bytes": list(raw),
        "top_logprobs": [
            {"token": b.decode("utf-8", "replace"), "logprob": v, "bytes": list(b)}
            for b, v in ((token_bytes(i), v) for i, v in tops)
        ],
    }


def chat_deltas(tokens: Tokens, plan: ChatPlan, run: Run, token_bytes: TokenBytes) -> Iterator[Delta]:
    """OpenAI ``delta`` dicts for the generated text, with the logprobs of the tokens behind them."""
    if plan.mode == "forced":
        yield from _forced_call_deltas(tokens, run, token_bytes, plan.fmt.call_ids if plan.fmt else "openai")
        return
    pending: list[dict[str, Any]] = []
    if plan.mode == "json":  # verbatim: a JSON string may hold "<think>" or a tool call's look
        for text, lp in tokens:
            if lp is not None:
                pending.append(_chat_logprob(lp, token_bytes))
            if text:
                yield {"content": text}, pending or None
                pending = []
        if pending:
            yield {}, pending
        return
    parser = make_parser(
        plan.fmt, in_reasoning=plan.in_reasoning, tools=plan.tools if plan.mode == "auto" and plan.tools else None
    )
    n_calls = 0
    id_style = plan.fmt.call_ids if plan.fmt is not None else "openai"
    one_call = False  # parallel_tool_calls is false and the call is made: nothing more is generated

    def flush(events: Any) -> Iterator[Delta]:
        nonlocal n_calls, pending, one_call
        for kind, value in events:
            if one_call:
                return
            if kind == "tool_name" and n_calls and not plan.parallel:
                one_call = True
                return
            if kind == "content":
                yield {"content": value}, pending or None
            elif kind == "reasoning":
                yield {"reasoning_content": value}, pending or None
            elif kind == "tool_name":  # a call opens: its id and name at once, the arguments as they come
                head = {"index": n_calls, "id": new_call_id(id_style), "type": "function"}
                yield {"tool_calls": [{**head, "function": {"name": value, "arguments": ""}}]}, pending or None
                n_calls += 1
            else:
                yield {"tool_calls": [{"index": n_calls - 1, "function": {"arguments": value}}]}, pending or None
            pending = []  # each logprob rides on the first delta after its token

    for text, lp in tokens:
        if lp is not None:
            pending.append(_chat_logprob(lp, token_bytes))
        if text:
            yield from flush(parser.feed(text))
        if one_call:
            close = getattr(tokens, "close", None)
            if close is not None:
                close()  # ends the generation: its slot is freed at the next step
            break
    else:
        yield from flush(parser.finish())
    if n_calls and run.finish_reason != "cancelled":
        run.finish_reason = "tool_calls"
    if pending:
        yield {}, pending


def _forced_call_deltas(tokens: Tokens, run: Run, token_bytes: TokenBytes, id_style: str) -> Iterator[Delta]:
    """A grammar-forced call streamed as it is generated: the name once complete, then pieces of the arguments."""
    pending: list[dict[str, Any]] = []
    forced = ForcedToolStream()
    call_id = new_call_id(id_style)
    raw: list[str] = []
    named = False
    for text, lp in tokens:
        if lp is not None:
            pending.append(_chat_logprob(lp, token_bytes))
        raw.append(text)
        for kind, value in forced.feed(text):
            if kind == "tool_name":
                named = True
                part = {"index": 0, "id": call_id, "type": "function", "function": {"name": value, "arguments": ""}}
            else:
                part = {"index": 0, "function": {"arguments": value}}
            yield {"tool_calls": [part]}, pending or None
            pending = []
    events, call = forced.finish()
    for _, value in events:
        yield {"tool_calls": [{"index": 0, "function": {"arguments": value}}]}, pending or None
        pending = []
    if call is not None:
        run.finish_reason = "tool_calls"
    elif not named and "".join(raw):
        yield {"content": "".join(raw)}, pending or None  # cut before the name: keep the text
        pending = []
    if pending:
        yield {}, pending


#: a chat delta tagged with the index of its choice
Indexed = tuple[int, Delta]


def chat_choices(
    jobs: list[Job],
    plan: ChatPlan,
    t_start: float,
    generate: Generate,
    token_bytes: TokenBytes,
    runs: list[Run],
    cancelled: Cancelled,
    *,
    window: int = 1,
) -> Iterator[Indexed]:
    """The deltas of every choice (``n`` jobs of one prompt), tagged with its index; fills ``runs`` in index order.
    Up to ``window`` choices generate at once, stepped together by the batch."""

    def deltas(index: int, run: Run, gone: Cancelled) -> Iterator[Delta]:
        return chat_deltas(generate(jobs[index], run, gone), plan, run, token_bytes)

    return interleave(_sources(len(jobs), t_start, runs, deltas), window, cancelled)


def _sources(
    n: int, t_start: float, runs: list[Run], make: Callable[[int, Run, Cancelled], Iterator[T]]
) -> list[Callable[[Cancelled], Iterator[T]]]:
    """The ``n`` generations of one request for :func:`interleave`: each gets its :class:`Run` (appended to
    ``runs`` as it starts, so in index order), the first timed from the request's start."""

    def source(index: int, gone: Cancelled) -> Iterator[T]:
        run = Run(t_start=t_start if index == 0 else time.perf_counter())
        runs.append(run)
        return make(index, run, gone)

    return [partial(source, i) for i in range(n)]


def _chat_usage(runs: list[Run]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Usage and timings of the choices of one prompt: the prompt counted once (OpenAI's), the tokens of all."""
    if len(runs) == 1:
        return runs[0].usage(), runs[0].timings()
    total = Run(t_start=runs[0].t_start)
    total.prompt_tokens, total.cached, total.prompt_ms = runs[0].prompt_tokens, runs[0].cached, runs[0].prompt_ms
    for r in runs:
        total.generated += r.generated
        total.times.extend(r.times)
    return total.usage(), total.timings()


def chat_message(base: dict[str, Any], deltas: Iterator[Indexed], runs: list[Run], jobs: list[Job]) -> dict[str, Any]:
    """The whole ``chat.completion`` answer, one choice per job, assembled from the deltas."""
    parts: list[dict[str, Any]] = [{"content": [], "reasoning": [], "calls": {}, "logprobs": []} for _ in jobs]
    for index, (delta, lps) in deltas:
        part = parts[index]
        if lps:
            part["logprobs"].extend(lps)
        if "content" in delta:
            part["content"].append(delta["content"])
        elif "reasoning_content" in delta:
            part["reasoning"].append(delta["reasoning_content"])
        elif "tool_calls" in delta:
            for piece in delta["tool_calls"]:
                call = part["calls"].setdefault(
                    piece["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                if "id" in piece:
                    call["id"] = piece["id"]
                    call["function"]["name"] = piece["function"]["name"]
                call["function"]["arguments"] += piece["function"].get("arguments", "")
    choices = []
    for index, (part, run, job) in enumerate(zip(parts, runs, jobs, strict=False)):
        message: dict[str, Any] = {"role": "assistant", "content": "".join(part["content"])}
        if part["reasoning"]:
            message["reasoning_content"] = "".join(part["reasoning"])
        calls = part["calls"]
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
            if not message["content"]:
                message["content"] = None
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": {"content": part["logprobs"]} if job.n_probs is not None else None,
                "finish_reason": run.finish,
                **run.stopped_by(),
            }
        )
    usage, timings = _chat_usage(runs)
    return {**base, "choices": choices, "usage": usage, "timings": timings}


def chat_stream(
    base: dict[str, Any],
    deltas: Iterator[Indexed],
    runs: list[Run],
    jobs: list[Job],
    include_usage: bool,
    cancelled: Cancelled,
) -> Iterator[dict[str, Any]]:
    """``chat.completion.chunk`` objects: per choice its role, one per delta, its finish reason; then usage if
    asked. Choices interleave as they are generated."""

    def role(index: int) -> dict[str, Any]:
        delta = {"role": "assistant", "content": None}
        return {**base, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]}

    # A choice's role chunk waits for its prompt to be evaluated: an error found there (context, image) then
    # still reaches the client as an HTTP error, and the first chunk marks the first token.
    started: set[int] = set()
    for index, (delta, lps) in deltas:
        if index not in started:
            started.add(index)
            yield role(index)
        if not delta and not lps:
            continue
        want_lp = jobs[index].n_probs is not None
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": {"content": lps} if want_lp and lps else None,
            "finish_reason": None,
        }
        yield {**base, "choices": [choice]}
    if cancelled() or any(r.finish_reason == "cancelled" for r in runs):
        return  # nobody is listening: no final chunk
    last: dict[str, Any] | None = None
    for index, run in enumerate(runs):
        if index not in started:
            yield role(index)
        if last is not None:
            yield last
        choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": run.finish, **run.stopped_by()}
        last = {**base, "choices": [choice]}
    assert last is not None
    usage, timings = _chat_usage(runs)
    if include_usage:
        yield last
        last = {**base, "choices": [], "usage": usage}
    last["timings"] = timings  # llama-server puts timings on the very last chunk
    yield last


# ----------------------------------------------------------------------------- text completions


def _completion_logprobs(items: list[tuple[Logprob, int]], token_bytes: TokenBytes) -> dict[str, Any]:
    """OpenAI completions logprobs for ``(lp, text_offset)`` pairs."""
    tokens, values, tops, offsets = [], [], [], []
    for (_, raw, value, alts), offset in items:
        tokens.append(raw.decode("utf-8", "replace"))
        values.append(value)
        tops.append({token_bytes(i).decode("utf-8", "replace"): v for i, v in alts})
        offsets.append(offset)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def completion(
    base: dict[str, Any], jobs: list[Job], chunks: Iterator[dict[str, Any]], runs: list[Run]
) -> dict[str, Any]:
    """The whole ``text_completion``, one choice per job in order, assembled from its :func:`completion_chunks`."""
    choices = [
        {
            "index": i,
            "text": "",
            "logprobs": _no_logprobs() if job.n_probs is not None else None,
            "finish_reason": "stop",
        }
        for i, job in enumerate(jobs)
    ]
    for chunk in chunks:
        for part in chunk["choices"]:
            choice = choices[part["index"]]
            choice["text"] += part["text"]
            for key, values in (part["logprobs"] or {}).items():
                choice["logprobs"][key] += values
    for choice, run in zip(choices, runs, strict=False):  # fewer runs when the client left: it gets nothing
        choice["finish_reason"] = run.finish
    usage, timings = _add_usage(runs)
    return {**base, "choices": choices, "usage": usage, "timings": timings}


def _no_logprobs() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def completion_chunks(
    base: dict[str, Any],
    jobs: list[Job],
    echo: bool,
    t_start: float,
    generate: Generate,
    token_bytes: TokenBytes,
    runs: list[Run],
    cancelled: Cancelled,
    *,
    window: int = 1,
) -> Iterator[dict[str, Any]]:
    """The ``text_completion`` chunks of every job, each tagged with its index; fills ``runs``, one per job started,
    in index order. Up to ``window`` jobs generate at once (the batch steps them together), so their chunks
    interleave. The last chunk carries the usage and timings of all."""

    def chunks(index: int, run: Run, gone: Cancelled) -> Iterator[dict[str, Any]]:
        return _job_chunks(base, index, jobs[index], run, echo, generate, token_bytes, gone)

    ended = 0
    for _, chunk in interleave(_sources(len(jobs), t_start, runs, chunks), window, cancelled):
        if chunk["choices"][0]["finish_reason"] is not None:
            ended += 1
            if ended == len(jobs):
                chunk["usage"], chunk["timings"] = _add_usage(runs)
        yield chunk


def _job_chunks(
    base: dict[str, Any],
    index: int,
    job: Job,
    run: Run,
    echo: bool,
    generate: Generate,
    token_bytes: TokenBytes,
    cancelled: Cancelled,
) -> Iterator[dict[str, Any]]:
    """One job's chunks: its text as it comes, then a chunk with its finish reason (none when cancelled)."""
    want_lp = job.n_probs is not None
    offset = 0
    if echo:
        yield {**base, "choices": [{"index": index, "text": job.prompt, "logprobs": None, "finish_reason": None}]}
        offset = len(job.prompt)
    pending: list[tuple[Logprob, int]] = []
    for text, lp in generate(job, run, cancelled):
        if lp is not None:
            pending.append((lp, offset))
            offset += len(lp[1].decode("utf-8", "replace"))
        if not text:
            continue
        logprobs = _completion_logprobs(pending, token_bytes) if want_lp else None
        yield {**base, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}]}
        pending = []
    if run.finish_reason == "cancelled" or cancelled():
        return
    logprobs = _completion_logprobs(pending, token_bytes) if want_lp and pending else None
    yield {**base, "choices": [{"index": index, "text": "", "logprobs": logprobs, "finish_reason": run.finish}]}

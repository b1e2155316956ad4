"""The chat calls of both clients (:class:`ChatCalls`): chat, complete, run, structured, embed, rerank, models,
stats, each written once as steps (see :mod:`lemonkit.client.calls`).

The module functions (``lemonkit.chat``, ...) run these on the shared default client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lemonkit.client import api_requests
from lemonkit.client import replay as provenance
from lemonkit.client.api_requests import Embeddings, Messages
from lemonkit.client.calls import SERVER, Blocking, Request, Steps, Stream, call, traced
from lemonkit.client.display import stream_view
from lemonkit.client.model_calls import ModelCalls
from lemonkit.client.results import ChatAccumulator, ChatResult, ModelList, Ranking

__all__ = ["ChatCalls"]


@contextlib.contextmanager
def _shown(fold: ChatAccumulator) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Fold each chunk into ``fold`` and show it; the view is closed (marked interrupted if the stream did not
    finish) whatever happens."""
    view = stream_view()
    finished = False
    try:
        yield lambda chunk: view.add(*fold.feed(chunk))
        finished = True
    finally:
        view.close(interrupted=not finished)


class ChatCalls:
    """Mixed into both clients."""

    @call
    def chat(
        self,
        prompt_or_messages: Messages,
        model: str | None = None,
        *,
        stream: bool = True,
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        response_format: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> Steps[ChatResult]:
        """Ask a chat model; with ``stream`` the answer shows as it arrives.

        In a notebook one output updates as tokens arrive (reasoning in a collapsed block) and becomes Markdown
        when the answer is complete; elsewhere the tokens are printed to stdout. Interrupting (Ctrl-C, the
        kernel's stop button) closes the stream, which stops the generation on the server.

        Args:
            prompt_or_messages: A user message, or OpenAI-style messages (``{"role", "content"}`` dicts).
            model: The model; ``None``: the loaded LLM, else the embedded default chat model
                (``lemonkit.catalog.config.default_chat_model()``, ``LEMONKIT_DEFAULT_CHAT_MODEL`` overrides it).
            stream: Stream and show the answer; ``False`` returns it silently when complete.
            system: A system message (replacing any in ``prompt_or_messages``).
            tools: OpenAI tool definitions; the calls come back in ``result.tool_calls``.
            response_format: OpenAI's ``response_format`` (see also :meth:`structured`).
            **sampling: ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ...: sent as they are. Without
                ``seed`` a random one is sent and recorded, so that :func:`lemonkit.replay` can rerun the request.

        Returns:
            A :class:`~lemonkit.client.results.ChatResult` with its ``provenance``.

        Raises:
            ModelNotFound: ``model`` is not registered.
            InvalidRequest: The server refused an argument.
            ServerUnavailable: No server could be reached or started.
            KeyboardInterrupt: Interrupted (the generation stopped on the server).

        Example:
            >>> result = lemonkit.Client().chat("Explain entropy in two sentences", max_tokens=80)
            >>> result.text, result.usage["completion_tokens"]
        """
        body = api_requests.chat_body(
            prompt_or_messages,
            model or api_requests.default_model((yield from ModelCalls.health.steps(self)), "llm"),
            stream=stream,
            system=system,
            tools=tools,
            response_format=response_format,
            sampling=sampling,
        )
        return (yield from ChatCalls.run.steps(self, "chat/completions", body))

    @call
    def complete(
        self, prompt: str, model: str | None = None, *, stream: bool = True, **sampling: Any
    ) -> Steps[ChatResult]:
        """Continue ``prompt`` with a text completion (``/v1/completions``), shown as :meth:`chat` shows answers.

        Args:
            prompt: The text to continue.
            model: As :meth:`chat`'s.
            stream: As :meth:`chat`'s.
            **sampling: As :meth:`chat`'s.

        Returns:
            A :class:`~lemonkit.client.results.ChatResult` (``text`` is the continuation).

        Raises:
            LemonkitError: As :meth:`chat`.

        Example:
            >>> lemonkit.Client().complete("The printing press", max_tokens=20, stream=False).text
        """
        model = model or api_requests.default_model((yield from ModelCalls.health.steps(self)), "llm")
        body = api_requests.completion_body(prompt, model, stream=stream, sampling=sampling)
        return (yield from ChatCalls.run.steps(self, "completions", body))

    @call
    def run(self, route: str, body: dict[str, Any]) -> Steps[ChatResult]:
        """Send a prepared ``chat/completions`` or ``completions`` body (what :func:`lemonkit.replay` reruns).

        Raises:
            LemonkitError: As :meth:`chat`.
        """
        clock, fold = provenance.Clock(), ChatAccumulator()
        headers: dict[str, str] = {}
        if body.get("stream"):
            with _shown(fold) as show:
                yield Stream(route, body, lambda event: show(event.data), headers_out=headers)
            result = fold.finish()
        else:
            result = fold.whole((yield Request("POST", route, {"json": body}, headers_out=headers)))
        result.provenance = provenance.build(route, body, headers, clock, (yield SERVER).api)
        return result

    @call
    def structured(self, prompt: Messages, schema: Any, model: str | None = None, **sampling: Any) -> Steps[Any]:
        """Ask for an answer shaped by a JSON schema (``response_format`` ``json_schema``) and parse it.

        Args:
            prompt: As :meth:`chat`'s ``prompt_or_messages``.
            schema: A JSON schema dict, or a pydantic model class (its ``model_json_schema()``).
            model: As :meth:`chat`'s.
            **sampling: As :meth:`chat`'s (give ``max_tokens`` room for the whole object).

        Returns:
            The parsed dict for a schema dict; an instance of the class for a pydantic model.

        Raises:
            StructuredOutputError: The answer was cut off or does not validate (``.result`` holds it).
            LemonkitError: As :meth:`chat`.

        Example:
            >>> class City(pydantic.BaseModel):
            ...     name: str
            ...     population: int
            >>> lemonkit.Client().structured("The largest city in France, as JSON.", City, max_tokens=60)
            City(name='Paris', population=2100000)
        """
        response_format = api_requests.schema_format(schema)
        result = yield from ChatCalls.chat.steps(
            self, prompt, model, stream=False, response_format=response_format, **sampling
        )
        return api_requests.parse_structured(result, schema)

    @call
    def embed(self, texts: str | Sequence[str], model: str | None = None) -> Steps[Embeddings]:
        """Embed texts.

        Args:
            texts: One text or several.
            model: An embedding model; ``None``: the loaded one, else
            ``lemonkit.catalog.config.default_embedding_model()``
                (``LEMONKIT_DEFAULT_EMBEDDING_MODEL`` overrides it).

        Returns:
            A float32 array, one row per text (``n x dim``), with a ``provenance`` attribute.

        Raises:
            NotEmbeddingModel: ``model`` is a chat model.
            LemonkitError: As :meth:`chat`.

        Example:
            >>> lemonkit.Client().embed(["a cat", "a dog"]).shape
            (2, 384)
        """
        inputs = [texts] if isinstance(texts, str) else list(texts)
        model = model or api_requests.default_model((yield from ModelCalls.health.steps(self)), "embedding")
        body = {"model": model, "input": inputs}
        answer, facts = yield from traced("embeddings", body)
        return api_requests.embeddings(answer, facts)

    @call
    def rerank(self, query: str, documents: Sequence[str], model: str | None = None) -> Steps[Ranking]:
        """Rank documents by relevance to a query, best first.

        No reranking model ships with lemonkit. With ``model=None`` the loaded reranking model is used, else a
        downloaded one (labelled ``reranking``); when there is none, the documents are ranked by the cosine of
        the default embedding model's vectors (``ranking.method == "embedding-cosine"``), which works offline.
        Pull a reranker (``lemonkit.pull("bge-reranker-v2-m3-GGUF")``) for cross-encoder scores.

        Args:
            query: What the documents should answer.
            documents: The candidates.
            model: A reranking model, or ``None`` (see above).

        Returns:
            A :class:`~lemonkit.client.results.Ranking` of ``(index, score, document)`` records, best first.

        Raises:
            LemonkitError: As :meth:`chat`.

        Example:
            >>> lemonkit.Client().rerank("pets", ["a cat", "the stock market"])[0].document
            'a cat'
        """
        docs = list(documents)
        if model is None:
            every = yield from ChatCalls.models.steps(self, all=True)
            model = api_requests.reranking_model(every, (yield from ModelCalls.health.steps(self)))
        if model is None:
            vectors = yield from ChatCalls.embed.steps(self, [query, *docs])
            return api_requests.cosine_ranking(vectors, docs, str(vectors.provenance.get("model")))
        answer = yield Request("POST", "rerank", {"json": {"model": model, "query": query, "documents": docs}})
        return api_requests.ranking(answer, docs, model)

    @call
    def models(self, all: bool = False, *, show_all: bool | None = None) -> Steps[ModelList]:
        """The models: the downloaded ones, or with ``all`` every registered one.

        Args:
            all: Every registered model, each with whether it runs here (``unsupported_reason``).
            show_all: The same as ``all`` (the route's name for it).

        Returns:
            A :class:`~lemonkit.client.results.ModelList` of ``/v1/models`` entries (``.to_pandas()`` for a DataFrame; a
            model browser in a notebook).

        Raises:
            ServerUnavailable: No server could be reached or started.

        Example:
            >>> lemonkit.Client().models().to_pandas()[["recipe", "downloaded"]]
        """
        every = all if show_all is None else show_all
        answer = yield Request("GET", "models", {"params": {"show_all": "true"} if every else {}})
        # an async client's list shows as a browser that drives a sync client of its own
        return ModelList(answer["data"], client=self if isinstance(self, Blocking) else None)

    @call
    def stats(self) -> Steps[dict[str, Any]]:
        """The engine's figures for the last generation of the last model used (``/v1/stats``).

        Returns:
            ``time_to_first_token``, ``tokens_per_second``, ``input_tokens``, ``output_tokens``, ``prompt_tokens``,
            ``cache_tokens`` (prompt tokens reused from the model's context), ``decode_token_times`` (``None``
            before any generation).

        Raises:
            ServerUnavailable: No server could be reached or started.

        Example:
            >>> lemonkit.Client().stats()["tokens_per_second"]
        """
        answer: dict[str, Any] = yield Request("GET", "stats")
        return answer

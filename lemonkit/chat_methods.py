"""The Python API's methods of :class:`~lemonkit.client.Client` (:class:`SyncMethods`) and
:class:`~lemonkit.client.AsyncClient` (:class:`AsyncMethods`): chat, complete, embed, rerank, structured, stats.

The module functions (``lemonkit.chat``, ...) call these on the shared default client.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from lemonkit import api_requests, provenance
from lemonkit.api_requests import Embeddings, Messages
from lemonkit.display import stream_view
from lemonkit.results import ChatAccumulator, ChatResult, ModelList, Ranking

if TYPE_CHECKING:
    from lemonkit.client import Event, Server

__all__ = ["AsyncMethods", "SyncMethods"]


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


class SyncMethods:
    """Mixed into :class:`~lemonkit.client.Client`."""

    if TYPE_CHECKING:

        @property
        def server(self) -> Server: ...

        def request(
            self, method: str, path: str, *, headers_out: dict[str, str] | None = None, **kwargs: Any
        ) -> Any: ...

        def events(
            self, path: str, body: dict[str, Any], *, headers_out: dict[str, str] | None = None
        ) -> Iterator[Event]: ...

        def health(self) -> dict[str, Any]: ...

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
    ) -> ChatResult:
        """Ask a chat model; with ``stream`` the answer shows as it arrives.

        In a notebook one output updates as tokens arrive (reasoning in a collapsed block) and becomes Markdown
        when the answer is complete; elsewhere the tokens are printed to stdout. Interrupting (Ctrl-C, the
        kernel's stop button) closes the stream, which stops the generation on the server.

        Args:
            prompt_or_messages: A user message, or OpenAI-style messages (``{"role", "content"}`` dicts).
            model: The model; ``None``: the loaded LLM, else the embedded default chat model
                (``lemonkit.config.default_chat_model()``, ``LEMONKIT_DEFAULT_CHAT_MODEL`` overrides it).
            stream: Stream and show the answer; ``False`` returns it silently when complete.
            system: A system message (replacing any in ``prompt_or_messages``).
            tools: OpenAI tool definitions; the calls come back in ``result.tool_calls``.
            response_format: OpenAI's ``response_format`` (see also :meth:`structured`).
            **sampling: ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ...: sent as they are. Without
                ``seed`` a random one is sent and recorded, so that :func:`lemonkit.replay` can rerun the request.

        Returns:
            A :class:`~lemonkit.results.ChatResult` with its ``provenance``.

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
            model or api_requests.default_model(self.health(), "llm"),
            stream=stream,
            system=system,
            tools=tools,
            response_format=response_format,
            sampling=sampling,
        )
        return self.run("chat/completions", body)

    def complete(self, prompt: str, model: str | None = None, *, stream: bool = True, **sampling: Any) -> ChatResult:
        """Continue ``prompt`` with a text completion (``/v1/completions``), shown as :meth:`chat` shows answers.

        Args:
            prompt: The text to continue.
            model: As :meth:`chat`'s.
            stream: As :meth:`chat`'s.
            **sampling: As :meth:`chat`'s.

        Returns:
            A :class:`~lemonkit.results.ChatResult` (``text`` is the continuation).

        Raises:
            LemonkitError: As :meth:`chat`.

        Example:
            >>> lemonkit.Client().complete("The printing press", max_tokens=20, stream=False).text
        """
        model = model or api_requests.default_model(self.health(), "llm")
        return self.run("completions", api_requests.completion_body(prompt, model, stream=stream, sampling=sampling))

    def run(self, route: str, body: dict[str, Any]) -> ChatResult:
        """Send a prepared ``chat/completions`` or ``completions`` body (what :func:`lemonkit.replay` reruns).

        Raises:
            LemonkitError: As :meth:`chat`.
        """
        clock, fold = provenance.Clock(), ChatAccumulator()
        headers: dict[str, str] = {}
        if body.get("stream"):
            with _shown(fold) as show:
                for event in self.events(route, body, headers_out=headers):
                    show(event.data)
            result = fold.finish()
        else:
            result = fold.whole(self.request("POST", route, json=body, headers_out=headers))
        result.provenance = provenance.build(route, body, headers, clock, self.server.api)
        return result

    def structured(self, prompt: Messages, schema: Any, model: str | None = None, **sampling: Any) -> Any:
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
        result = self.chat(prompt, model, stream=False, response_format=api_requests.schema_format(schema), **sampling)
        return api_requests.parse_structured(result, schema)

    def embed(self, texts: str | Sequence[str], model: str | None = None) -> Embeddings:
        """Embed texts.

        Args:
            texts: One text or several.
            model: An embedding model; ``None``: the loaded one, else ``lemonkit.config.default_embedding_model()``
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
        body = {"model": model or api_requests.default_model(self.health(), "embedding"), "input": inputs}
        clock, headers = provenance.Clock(), dict[str, str]()
        answer = self.request("POST", "embeddings", json=body, headers_out=headers)
        return api_requests.embeddings(answer, provenance.build("embeddings", body, headers, clock, self.server.api))

    def rerank(self, query: str, documents: Sequence[str], model: str | None = None) -> Ranking:
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
            A :class:`~lemonkit.results.Ranking` of ``(index, score, document)`` records, best first.

        Raises:
            LemonkitError: As :meth:`chat`.

        Example:
            >>> lemonkit.Client().rerank("pets", ["a cat", "the stock market"])[0].document
            'a cat'
        """
        docs = list(documents)
        model = model or api_requests.reranking_model(self.models(all=True), self.health())
        if model is None:
            vectors = self.embed([query, *docs])
            return api_requests.cosine_ranking(vectors, docs, str(vectors.provenance.get("model")))
        answer = self.request("POST", "rerank", json={"model": model, "query": query, "documents": docs})
        return api_requests.ranking(answer, docs, model)

    def models(self, all: bool = False, *, show_all: bool | None = None) -> ModelList:
        """The models: the downloaded ones, or with ``all`` every registered one.

        Args:
            all: Every registered model, each with whether it runs here (``unsupported_reason``).
            show_all: The same as ``all`` (the route's name for it).

        Returns:
            A :class:`~lemonkit.results.ModelList` of ``/v1/models`` entries (``.to_pandas()`` for a DataFrame; a
            model browser in a notebook).

        Raises:
            ServerUnavailable: No server could be reached or started.

        Example:
            >>> lemonkit.Client().models().to_pandas()[["recipe", "downloaded"]]
        """
        every = all if show_all is None else show_all
        data = self.request("GET", "models", params={"show_all": "true"} if every else {})["data"]
        return ModelList(data, client=self)

    def stats(self) -> dict[str, Any]:
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
        answer: dict[str, Any] = self.request("GET", "stats")
        return answer


class AsyncMethods:
    """Mixed into :class:`~lemonkit.client.AsyncClient`: :class:`SyncMethods`' methods, awaitable (an async stream
    shows as the sync one does)."""

    if TYPE_CHECKING:

        async def server(self) -> Server: ...

        async def request(
            self, method: str, path: str, *, headers_out: dict[str, str] | None = None, **kwargs: Any
        ) -> Any: ...

        def events(
            self, path: str, body: dict[str, Any], *, headers_out: dict[str, str] | None = None
        ) -> AsyncIterator[Event]: ...

        async def health(self) -> dict[str, Any]: ...

    async def chat(
        self,
        prompt_or_messages: Messages,
        model: str | None = None,
        *,
        stream: bool = True,
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        response_format: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> ChatResult:
        """See :meth:`SyncMethods.chat`."""
        body = api_requests.chat_body(
            prompt_or_messages,
            model or api_requests.default_model(await self.health(), "llm"),
            stream=stream,
            system=system,
            tools=tools,
            response_format=response_format,
            sampling=sampling,
        )
        return await self.run("chat/completions", body)

    async def complete(
        self, prompt: str, model: str | None = None, *, stream: bool = True, **sampling: Any
    ) -> ChatResult:
        """See :meth:`SyncMethods.complete`."""
        model = model or api_requests.default_model(await self.health(), "llm")
        return await self.run(
            "completions", api_requests.completion_body(prompt, model, stream=stream, sampling=sampling)
        )

    async def run(self, route: str, body: dict[str, Any]) -> ChatResult:
        """See :meth:`SyncMethods.run`."""
        clock, fold = provenance.Clock(), ChatAccumulator()
        headers: dict[str, str] = {}
        if body.get("stream"):
            with _shown(fold) as show:
                async for event in self.events(route, body, headers_out=headers):
                    show(event.data)
            result = fold.finish()
        else:
            result = fold.whole(await self.request("POST", route, json=body, headers_out=headers))
        result.provenance = provenance.build(route, body, headers, clock, (await self.server()).api)
        return result

    async def structured(self, prompt: Messages, schema: Any, model: str | None = None, **sampling: Any) -> Any:
        """See :meth:`SyncMethods.structured`."""
        response_format = api_requests.schema_format(schema)
        result = await self.chat(prompt, model, stream=False, response_format=response_format, **sampling)
        return api_requests.parse_structured(result, schema)

    async def embed(self, texts: str | Sequence[str], model: str | None = None) -> Embeddings:
        """See :meth:`SyncMethods.embed`."""
        inputs = [texts] if isinstance(texts, str) else list(texts)
        body = {"model": model or api_requests.default_model(await self.health(), "embedding"), "input": inputs}
        clock, headers = provenance.Clock(), dict[str, str]()
        answer = await self.request("POST", "embeddings", json=body, headers_out=headers)
        facts = provenance.build("embeddings", body, headers, clock, (await self.server()).api)
        return api_requests.embeddings(answer, facts)

    async def rerank(self, query: str, documents: Sequence[str], model: str | None = None) -> Ranking:
        """See :meth:`SyncMethods.rerank`."""
        docs = list(documents)
        model = model or api_requests.reranking_model(await self.models(all=True), await self.health())
        if model is None:
            vectors = await self.embed([query, *docs])
            return api_requests.cosine_ranking(vectors, docs, str(vectors.provenance.get("model")))
        answer = await self.request("POST", "rerank", json={"model": model, "query": query, "documents": docs})
        return api_requests.ranking(answer, docs, model)

    async def models(self, all: bool = False, *, show_all: bool | None = None) -> ModelList:
        """See :meth:`SyncMethods.models`."""
        every = all if show_all is None else show_all
        data = (await self.request("GET", "models", params={"show_all": "true"} if every else {}))["data"]
        return ModelList(data)  # the browser it displays as drives a sync client of its own

    async def stats(self) -> dict[str, Any]:
        """See :meth:`SyncMethods.stats`."""
        answer: dict[str, Any] = await self.request("GET", "stats")
        return answer

"""Each client call written once, as steps that both clients drive.

A call is a generator method: it yields the exchanges with the server it needs (:class:`Request`,
:class:`Stream`, :data:`SERVER`), is sent back each answer, and returns its result. :class:`call` makes it a
method of both clients: on a :class:`~lemonkit.client.Client` it runs the steps over a blocking connection; on an
:class:`~lemonkit.client.AsyncClient` it is a coroutine that awaits each one. The module functions
(``lemonkit.chat``, ...) run the same steps on the default client (:func:`lemonkit.api.on_default_client`). A
parameter is declared, and documented, in one place; no code here knows whether it blocks.

An exception raised while a step is performed (an error answer, a dropped connection, ``KeyboardInterrupt``, a
cancelled task) is thrown into the call at its ``yield``, so its ``finally`` and ``with`` blocks run (a streamed
answer's display is closed as interrupted) before it reaches the caller.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from lemonkit.client import replay as provenance

if TYPE_CHECKING:
    from lemonkit.client._client import Event, Server

__all__ = ["SERVER", "Awaiting", "Blocking", "Request", "Run", "Step", "Steps", "Stream", "call", "event_stream"]

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class Request:
    """One HTTP exchange; answered with the JSON of its answer (with ``raw``, its bytes). ``headers_out`` is
    filled with the answer's headers."""

    method: str
    path: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    headers_out: dict[str, str] | None = None
    raw: bool = False


@dataclass(frozen=True)
class Stream:
    """A POST answered with server-sent events, each handed to ``on_event`` as it arrives; answered ``None`` when
    the stream ends."""

    path: str
    body: dict[str, Any]
    on_event: Callable[[Event], None]
    headers_out: dict[str, str] | None = None


class _ServerStep:
    """Answered with the :class:`~lemonkit.client.Server` the client talks to (found first if it was not)."""


SERVER = _ServerStep()

Step = Request | Stream | _ServerStep
#: what a call's generator is: it yields steps, is sent their answers, and returns ``T``
Steps = Generator[Step, Any, T]


def traced(route: str, body: dict[str, Any], **request: Any) -> Steps[tuple[Any, dict[str, Any]]]:
    """POST one request whose result carries a provenance; returns the answer and that provenance.

    Args:
        route: The API route (``"embeddings"``).
        body: What the provenance records as the request (the JSON body, or a form's fields).
        **request: The request's httpx arguments (default: ``json=body``); ``raw=True`` answers bytes.
    """
    clock, headers = provenance.Clock(), dict[str, str]()
    raw = bool(request.pop("raw", False))
    answer = yield Request("POST", route, request or {"json": body}, headers_out=headers, raw=raw)
    server: Server = yield SERVER
    return answer, provenance.build(route, body, headers, clock, server.api)


class Run(Generic[T]):
    """One call's steps being driven: the driver asks :meth:`next` for a step, performs it, and reports the answer
    (:meth:`answer`) or the exception (:meth:`fail`), until :meth:`next` says ``None``; then :attr:`result`."""

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self._answer: Any = None
        self._error: BaseException | None = None
        self.result: T

    def next(self) -> Step | None:
        error, self._error = self._error, None
        try:
            return self._steps.throw(error) if error is not None else self._steps.send(self._answer)
        except StopIteration as done:
            self.result = done.value
            return None

    def answer(self, value: Any) -> None:
        self._answer = value

    def fail(self, error: BaseException) -> None:
        self._error = error


class Blocking:
    """A client that performs steps over a blocking connection (:class:`~lemonkit.client.Client`)."""

    def _run(self, steps: Steps[T]) -> T:
        run = Run(steps)
        while (step := run.next()) is not None:
            try:
                run.answer(self._perform(step))
            except BaseException as error:  # into the call, whose cleanup runs before it re-raises
                run.fail(error)
        return run.result

    def _perform(self, step: Step) -> Any:
        raise NotImplementedError


class Awaiting:
    """A client that awaits each step (:class:`~lemonkit.client.AsyncClient`)."""

    async def _run(self, steps: Steps[T]) -> T:
        run = Run(steps)
        while (step := run.next()) is not None:
            try:
                run.answer(await self._perform(step))
            except BaseException as error:  # a cancelled task too: the call cleans up, then it propagates
                run.fail(error)
        return run.result

    async def _perform(self, step: Step) -> Any:
        raise NotImplementedError


class _Method:
    """The runtime half of :class:`call` and :class:`event_stream`: the steps, and the method each kind of client
    gets (with the steps' name, doc and signature, so ``help(client.chat)`` reads as if it were written there)."""

    def __init__(self, steps: Callable[..., Any], blocking: Callable[..., Any], awaiting: Callable[..., Any]) -> None:
        self.steps = steps
        self.__doc__ = steps.__doc__
        self.__name__ = steps.__name__
        signature = inspect.signature(steps)
        returns = signature.return_annotation
        if isinstance(returns, str) and returns.startswith("Steps[") and returns.endswith("]"):
            signature = signature.replace(return_annotation=returns[len("Steps[") : -1])
        #: the call's parameters as a caller sees them (without ``self``)
        self.signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        for runner in (blocking, awaiting):
            functools.update_wrapper(runner, steps)
            del runner.__wrapped__  # type: ignore[attr-defined]  # the signature below is the one to show
            runner.__signature__ = signature  # type: ignore[attr-defined]
        self._blocking, self._awaiting = blocking, awaiting

    def _bind(self, client: Any) -> Any:
        if client is None:
            return self
        return types.MethodType(self._awaiting if isinstance(client, Awaiting) else self._blocking, client)


class call(_Method, Generic[P, T]):
    """A client call written once: ``steps(self, ...)`` is its generator; as an attribute of a client it is the
    method (blocking on a :class:`Blocking` client, a coroutine on an :class:`Awaiting` one)."""

    steps: Callable[Concatenate[Any, P], Steps[T]]

    def __init__(self, steps: Callable[Concatenate[Any, P], Steps[T]]) -> None:
        def blocking(client: Blocking, *args: Any, **kwargs: Any) -> T:
            return client._run(steps(client, *args, **kwargs))

        async def awaiting(client: Awaiting, *args: Any, **kwargs: Any) -> T:
            return await client._run(steps(client, *args, **kwargs))

        super().__init__(steps, blocking, awaiting)

    @overload
    def __get__(self, client: None, owner: type | None = None) -> call[P, T]: ...
    @overload
    def __get__(self, client: Blocking, owner: type | None = None) -> Callable[P, T]: ...
    @overload
    def __get__(self, client: Awaiting, owner: type | None = None) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, client: Any, owner: type | None = None) -> Any:
        return self._bind(client)


class event_stream(_Method, Generic[P]):
    """A call whose result is a stream of server-sent events the caller iterates: ``steps`` returns the POST's
    ``(path, body)``; a :class:`Blocking` client's method yields the events, an :class:`Awaiting` one's is an
    async iterator of them. Leaving the iteration early closes the stream."""

    steps: Callable[Concatenate[Any, P], Steps[tuple[str, dict[str, Any]]]]

    def __init__(self, steps: Callable[Concatenate[Any, P], Steps[tuple[str, dict[str, Any]]]]) -> None:
        def blocking(client: Any, *args: Any, **kwargs: Any) -> Iterator[Event]:
            path, body = client._run(steps(client, *args, **kwargs))
            yield from client.events(path, body)

        async def awaiting(client: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Event]:
            path, body = await client._run(steps(client, *args, **kwargs))
            async for event in client.events(path, body):
                yield event

        super().__init__(steps, blocking, awaiting)

    @overload
    def __get__(self, client: None, owner: type | None = None) -> event_stream[P]: ...
    @overload
    def __get__(self, client: Blocking, owner: type | None = None) -> Callable[P, Iterator[Event]]: ...
    @overload
    def __get__(self, client: Awaiting, owner: type | None = None) -> Callable[P, AsyncIterator[Event]]: ...
    def __get__(self, client: Any, owner: type | None = None) -> Any:
        return self._bind(client)

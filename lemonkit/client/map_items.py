"""``lemonkit.map``: a prompt template or a function over many items, concurrently, with a progress bar."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from lemonkit.client import Client
from lemonkit.client.results import ChatResult
from lemonkit.errors import LemonkitError, ServerUnavailable

__all__ = ["MapError", "MapResult", "map_items"]

#: seconds before the first retry of a transient failure; doubled at each further one
_BACKOFF = 0.5


@dataclass
class MapError:
    """The slot of an item that failed: what was tried and what went wrong.

    Attributes:
        index: The item's position in the input.
        item: The item.
        error: The last exception.
        attempts: How many times it was tried.
    """

    index: int
    item: Any
    error: BaseException
    attempts: int

    def __repr__(self) -> str:
        return f"MapError(index={self.index}, error={self.error!r}, attempts={self.attempts})"


class MapResult(list[Any]):
    """The outputs in input order: a :class:`~lemonkit.client.results.ChatResult` (a template's or a function's prompt),
    whatever a function returned, a :class:`MapError` for an item that failed, or ``None`` for an item that had not
    finished when the run was interrupted (:attr:`pending` lists those).

    Attributes:
        interrupted: The run was interrupted (KeyboardInterrupt); the finished items are kept.
    """

    def __init__(self, size: int) -> None:
        super().__init__([None] * size)
        self.interrupted = False
        self._finished: set[int] = set()

    def finish(self, index: int, value: Any) -> None:
        self[index] = value
        self._finished.add(index)

    @property
    def errors(self) -> list[MapError]:
        """The failed items' errors, in input order."""
        return [r for r in self if isinstance(r, MapError)]

    @property
    def pending(self) -> list[int]:
        """Indexes of the items that did not finish (an interrupted run)."""
        return [i for i in range(len(self)) if i not in self._finished]

    def to_pandas(self) -> Any:
        """A ``pandas.DataFrame`` in input order: ``output`` (a result's text, or the value) and ``error``."""
        import pandas as pd

        rows = []
        for r in self:
            if isinstance(r, MapError):
                rows.append({"output": None, "error": f"{type(r.error).__name__}: {r.error}"})
            else:
                rows.append({"output": r.text if isinstance(r, ChatResult) else r, "error": None})
        return pd.DataFrame(rows, columns=["output", "error"])


def transient(exc: BaseException) -> bool:
    """Worth retrying: the server unreachable, a server error (5xx) or too many requests (429); never a 4xx."""
    if isinstance(exc, ServerUnavailable | ConnectionError | TimeoutError):
        return True
    return isinstance(exc, LemonkitError) and (exc.status >= 500 or exc.status == 429)


def _items(items: Any) -> list[Any]:
    """The items as a list: a DataFrame's rows as dicts (``{column}`` fields), a Series' values."""
    if hasattr(items, "to_dict") and hasattr(items, "columns"):
        return list(items.to_dict("records"))
    return list(items)


def _task(fn_or_template: str | Callable[[Any], Any], client: Client, **sampling: Any) -> Callable[[Any], Any]:
    """What runs for one item: a template filled and asked, or the function (whose string answer is asked)."""

    def ask(prompt: Any) -> Any:
        return client.chat(prompt, stream=False, **sampling) if isinstance(prompt, str) else prompt

    if isinstance(fn_or_template, str):
        template = fn_or_template

        def fill(item: Any) -> Any:
            return ask(template.format(**item) if isinstance(item, dict) else template.format(item))

        return fill
    fn = fn_or_template
    return lambda item: ask(fn(item))


def map_items(
    fn_or_prompt_template: str | Callable[[Any], Any],
    items: Iterable[Any],
    *,
    concurrency: int = 4,
    retries: int = 2,
    progress: bool = True,
    client: Client | None = None,
    **sampling: Any,
) -> MapResult:
    """Run a prompt template or a function over items, ``concurrency`` at a time, with a progress bar.

    Args:
        fn_or_prompt_template: A template (``"Summarise: {}"``; with a DataFrame, ``"{title}: {body}"`` names
            its columns; a dict item fills ``{name}`` fields), or a function of one item returning a prompt (asked
            as :func:`lemonkit.chat` asks, not streamed) or any other value (kept as it is; it may call
            lemonkit itself).
        items: A list (any iterable), a ``pandas.Series``, or a ``DataFrame`` (one item per row, as a dict).
        concurrency: Items in flight at once.
        retries: Further attempts of an item after a transient failure (unreachable server, 5xx, 429), with a
            backoff; other errors are final at once.
        progress: Show a tqdm bar.
        client: The client (default: :func:`lemonkit.default_client`).
        **sampling: For the chat requests (``max_tokens``, ``temperature``, ...).

    Returns:
        A :class:`MapResult` in input order; an item that failed holds a :class:`MapError` (the run goes on).
        Interrupting (Ctrl-C, the kernel's stop button) returns the items finished so far, ``interrupted`` set;
        the requests in flight finish in the background.

    Example:
        >>> out = lemonkit.map("Translate to French: {}", ["cat", "dog"], max_tokens=10)
        >>> out.to_pandas()
    """
    from tqdm.auto import tqdm

    from lemonkit.client import default_client

    inputs = _items(items)
    task = _task(fn_or_prompt_template, client or default_client(), **sampling)
    results = MapResult(len(inputs))
    stop = threading.Event()

    def attempt(index: int) -> Any:
        for tries in range(1, retries + 2):
            try:
                return task(inputs[index])
            except Exception as exc:
                if tries > retries or not transient(exc) or stop.wait(_BACKOFF * 2 ** (tries - 1)):
                    return MapError(index, inputs[index], exc, tries)
        raise AssertionError("unreachable")

    pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="lemonkit-map")
    futures: dict[Future[Any], int] = {pool.submit(attempt, i): i for i in range(len(inputs))}
    with tqdm(total=len(inputs), disable=not progress, desc="lemonkit.map") as bar:
        try:
            remaining = set(futures)
            while remaining:
                done, remaining = wait(remaining, return_when=FIRST_COMPLETED)
                for future in done:
                    results.finish(futures[future], future.result())
                bar.update(len(done))
                bar.set_postfix(errors=len(results.errors), refresh=False)
        except KeyboardInterrupt:
            results.interrupted = True
            stop.set()
            for future, index in futures.items():  # finished while the interrupt was being raised: kept too
                if future.done() and not future.cancelled():
                    results.finish(index, future.result())
        finally:
            pool.shutdown(wait=not results.interrupted, cancel_futures=True)
    return results

"""``lemonkit.map``: a prompt template or a function over many items, with a progress bar.

A template's rows go to the server as one durable batch (OpenAI's Batch API, :mod:`lemonkit.server.batches`): first
the answer cache is asked for every row at once (``POST /v1/cache/lookup``), so a cell run again returns what it
computed before at once and sends only new or changed rows; those run as a batch the server keeps going whatever
happens to the kernel. The batch carries the rows' fingerprint in its metadata, so running the cell again while it
runs (after a kernel restart, an interrupt) follows that batch rather than starting another. Unseeded sampling gets a
seed per row from one map seed and the row's prompt: every run is reproducible, and cacheable. A function argument
runs client-side, concurrently, as before.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from lemonkit.client import Client, api_requests
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
        #: what the run cost (a template's run, on the server): ``rows``, ``cache_hits`` (rows answered by the
        #: answer cache, from this run's lookup or inside its batch), ``computed``, ``failed``, ``prompt_tokens``,
        #: ``cached_tokens``, ``generated_tokens``, ``wall_seconds``, ``rows_per_second``, ``engine_seconds``, and the
        #: ``batch_id`` that computed the rest (``None`` when the cache had every row)
        self.stats: dict[str, Any] = {}
        #: the server batch that computed this run's rows (an interrupted run's keeps going there)
        self.batch_id: str | None = None

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
        """A ``pandas.DataFrame`` in input order: ``output`` (a result's text, or the value) and ``error``; typed
        rows (``schema=``: pydantic models or dicts) give one column per field instead of ``output``."""
        import pandas as pd

        typed = [r for r in self if r is not None and not isinstance(r, MapError | ChatResult)]
        fields = all(isinstance(r, dict) or hasattr(r, "model_dump") for r in typed) and bool(typed)
        rows: list[dict[str, Any]] = []
        for r in self:
            if isinstance(r, MapError):
                rows.append({"error": f"{type(r.error).__name__}: {r.error}"})
            elif fields and r is not None:
                rows.append({**(r.model_dump() if hasattr(r, "model_dump") else r), "error": None})
            else:
                rows.append({"output": r.text if isinstance(r, ChatResult) else r, "error": None})
        frame = pd.DataFrame(rows)
        columns = [c for c in frame.columns if c != "error"] or ([] if fields else ["output"])
        return frame.reindex(columns=[*columns, "error"])


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


def _task(
    fn: Callable[[Any], Any],
    client: Client,
    model: str | None,
    system: str | None,
    schema: Any,
    sampling: dict[str, Any],
) -> Callable[[Any], Any]:
    """What runs for one item: the function, and its answer asked when it is a prompt (parsed with ``schema``)."""

    def ask(prompt: Any) -> Any:
        if not isinstance(prompt, str):
            return prompt
        format_ = api_requests.schema_format(schema) if schema is not None else None
        result = client.chat(prompt, model, stream=False, system=system, response_format=format_, **sampling)
        return api_requests.parse_structured(result, schema) if schema is not None else result

    return lambda item: ask(fn(item))


def _row_seed(map_seed: int, prompt: str) -> int:
    """The seed of one unseeded row: from the map's seed and the row's prompt, so a row keeps its seed (and its
    cached answer) when rows are added, removed or reordered around it."""
    digest = hashlib.sha256(f"{map_seed}\x00{prompt}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def map_items(
    fn_or_prompt_template: str | Callable[[Any], Any],
    items: Iterable[Any],
    *,
    model: str | None = None,
    schema: Any = None,
    system: str | None = None,
    seed: int | None = None,
    map_seed: int = 0,
    concurrency: int = 4,
    retries: int = 2,
    progress: bool = True,
    client: Client | None = None,
    **sampling: Any,
) -> MapResult:
    """Run a prompt template or a function over items, with a progress bar.

    A template's rows run on the server as one batch (see the module's doc): rows computed before come from the
    answer cache at once, the rest in the model's slots; interrupting leaves that batch running (the cell run again
    picks it up).

    Args:
        fn_or_prompt_template: A template (``"Summarise: {}"``; with a DataFrame, ``"{title}: {body}"`` names
            its columns; a dict item fills ``{name}`` fields), or a function of one item returning a prompt (asked
            as :func:`lemonkit.chat` asks, not streamed) or any other value (kept as it is; it may call
            lemonkit itself). A function runs here, ``concurrency`` at a time.
        items: A list (any iterable), a ``pandas.Series``, or a ``DataFrame`` (one item per row, as a dict).
        model: The chat model (default: as :func:`lemonkit.chat` chooses).
        schema: A pydantic model class or a JSON schema dict: each row's answer is that JSON (``response_format``
            ``json_schema``), returned parsed (an instance, or a dict); ``to_pandas()`` gives a column per field.
        system: A system message for every row.
        seed: One seed for every row; by default each row gets its own, from ``map_seed`` and its prompt.
        map_seed: What the rows' seeds derive from, when ``seed`` is not given.
        concurrency: A function's items in flight at once.
        retries: A function's further attempts after a transient failure (unreachable server, 5xx, 429).
        progress: Show a tqdm bar (rows/s, what is left, cache hits, tokens).
        client: The client (default: :func:`lemonkit.default_client`).
        **sampling: For the chat requests (``max_tokens``, ``temperature``, ...).

    Returns:
        A :class:`MapResult` in input order; an item that failed holds a :class:`MapError` (the run goes on).
        ``stats`` says what it cost. Interrupting (Ctrl-C, the kernel's stop button) returns the rows finished so
        far, ``interrupted`` set.

    Example:
        >>> out = lemonkit.map("Translate to French: {}", ["cat", "dog"], max_tokens=10)
        >>> out.to_pandas()
    """
    from lemonkit.client import default_client

    inputs = _items(items)
    client = client or default_client()
    if not isinstance(fn_or_prompt_template, str):
        if seed is not None:
            sampling = {**sampling, "seed": seed}
        task = _task(fn_or_prompt_template, client, model, system, schema, sampling)
        return _map_function(task, inputs, concurrency, retries, progress)
    from lemonkit.client.map_batch import MapBatch

    template = fn_or_prompt_template
    prompts = [template.format(**item) if isinstance(item, dict) else template.format(item) for item in inputs]
    run = MapBatch(client, prompts, inputs, model=model, schema=schema, system=system, progress=progress)
    return run.run(lambda prompt: seed if seed is not None else _row_seed(map_seed, prompt), sampling)


def _map_function(
    task: Callable[[Any], Any], inputs: list[Any], concurrency: int, retries: int, progress: bool
) -> MapResult:
    """A function's task over the items, client-side, ``concurrency`` at a time."""
    from tqdm.auto import tqdm

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

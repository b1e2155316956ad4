"""The model-management calls of both clients (:class:`ModelCalls`): health, model, variants, pull, load,
unload, delete, each written once as steps (see :mod:`lemonkit.client.calls`)."""

from __future__ import annotations

from typing import Any

from lemonkit.client.calls import Request, Steps, call, event_stream
from lemonkit.errors import InvalidArgument

__all__ = ["ModelCalls", "pull_body"]


def pull_body(
    model: str,
    *,
    variants: dict[str, Any] | None = None,
    variant: str | None = None,
    checkpoint: str | None = None,
    recipe: str = "llamacpp",
    mmproj: str | None = None,
    flags: dict[str, bool] | None = None,
    remote_url: str | None = None,
    remote_urls: list[str] | None = None,
    api_key_env: str | None = None,
) -> dict[str, Any]:
    """The streaming ``/v1/pull`` body for ``model``.

    Args:
        model: A registered name, ``user.<name>`` (with ``checkpoint``) or ``owner/repo``.
        variants: For ``owner/repo``, the hub's ``/v1/pull/variants`` answer: the model registers as
            ``user.<suggested name>`` with the suggested labels and projector.
        variant: The variant of ``owner/repo`` (default: the top one).
        checkpoint: Register ``model`` on this ``repo:variant``.
        recipe: The recipe of a registration.
        mmproj: The vision projector of a registration.
        flags: ``reasoning``/``vision``/``embedding``/``reranking`` of a registration.
        remote_url: A ``remote`` registration's upstream OpenAI base URL (``http://host:8000/v1``).
        remote_urls: Several upstreams of one ``remote`` model (balanced, with failover).
        api_key_env: The server's environment variable (or secrets file entry) holding the upstream's key.

    Raises:
        InvalidArgument: ``owner/repo`` has no variant to pick.
    """
    flags = {k: v for k, v in (flags or {}).items() if v}
    body: dict[str, Any] = {"model_name": model, "stream": True}
    remote = {"remote_url": remote_url, "remote_urls": remote_urls, "api_key_env": api_key_env}
    if any(v is not None for v in remote.values()):
        body.update({k: v for k, v in remote.items() if v is not None}, recipe="remote")
    if checkpoint:
        body.setdefault("recipe", recipe)
        return {**body, "checkpoint": checkpoint, **({"mmproj": mmproj} if mmproj else {}), **flags}
    if variants is None:
        return body
    if not variant:
        if not variants["variants"]:
            raise InvalidArgument(f"{variants['checkpoint']} has no GGUF variant; name one as {model}:<file>")
        variant = variants["variants"][0]["name"]
    labels = variants["suggested_labels"]
    body.update(
        model_name=f"user.{variants['suggested_name']}",
        checkpoint=f"{variants['checkpoint']}:{variant}",
        recipe=variants["recipe"],
    )
    for flag, label in (("vision", "vision"), ("embedding", "embeddings"), ("reranking", "reranking")):
        if label in labels:
            body[flag] = True
    if "vision" in labels and variants["mmproj_files"]:
        body["mmproj"] = variants["mmproj_files"][0]
    return {**body, **flags}


def _split_repo(model: str) -> tuple[str, str | None] | None:
    """``owner/repo[:variant]`` -> ``(repo, variant)``; ``None`` for a model name."""
    if "/" not in model:
        return None
    repo, _, variant = model.partition(":")
    return repo, variant or None


class ModelCalls:
    """Mixed into both clients."""

    @call
    def health(self) -> Steps[dict[str, Any]]:
        """The server's ``/v1/health``: version, loaded models (``all_models_loaded``: name, type, pid, options).

        Raises:
            ServerUnavailable: No server could be reached or started.

        Example:
            >>> lemonkit.Client().health()["model_loaded"]
        """
        answer: dict[str, Any] = yield Request("GET", "health")
        return answer

    @call
    def model(self, name: str) -> Steps[dict[str, Any]]:
        """One model's ``/v1/models/{name}`` entry.

        Raises:
            ModelNotFound: ``name`` is not registered.
        """
        answer: dict[str, Any] = yield Request("GET", f"models/{name}")
        return answer

    @call
    def variants(self, checkpoint: str) -> Steps[dict[str, Any]]:
        """The GGUF variants of a hub repo (``GET /v1/pull/variants``)."""
        answer: dict[str, Any] = yield Request("GET", "pull/variants", {"params": {"checkpoint": checkpoint}})
        return answer

    @call
    def pull_request(self, model: str, **registration: Any) -> Steps[dict[str, Any]]:
        """The ``/v1/pull`` body for ``model`` (see :func:`pull_body`), asking the hub about an ``owner/repo``."""
        repo = _split_repo(model) if not registration.get("checkpoint") else None
        info = (yield from ModelCalls.variants.steps(self, repo[0])) if repo else None
        return pull_body(model, variants=info, variant=repo[1] if repo else None, **registration)

    @event_stream
    def pull(self, model: str, **registration: Any) -> Steps[tuple[str, dict[str, Any]]]:
        """Pull ``model`` (see :func:`pull_body` for ``model`` and ``registration``); yields the SSE
        ``progress``/``complete``/``error`` events. Leaving the iteration early pauses the download."""
        return "pull", (yield from ModelCalls.pull_request.steps(self, model, **registration))

    @call
    def load(self, name: str, **options: Any) -> Steps[dict[str, Any]]:
        """Load a model (downloading it first if needed).

        Args:
            name: The model.
            **options: ``/v1/load`` options: ``ctx_size``, ``llamacpp_args``, ``pinned``, ``save_options``, ...

        Returns:
            The server's answer (``{"status": "success", "message": ...}``).

        Raises:
            ModelNotFound: ``name`` is not registered.
            ModelLoadError: The engine failed to load it.

        Example:
            >>> lemonkit.Client().load("Gemma-3-270m-GGUF", ctx_size=4096)
        """
        answer: dict[str, Any] = yield Request("POST", "load", {"json": {"model_name": name, **options}})
        return answer

    @call
    def unload(self, name: str | None = None) -> Steps[dict[str, Any]]:
        """Unload a model, or every model (its process exits and gives its memory back).

        Args:
            name: The model; ``None``: all of them.

        Returns:
            The server's answer.

        Raises:
            ModelNotFound: ``name`` is not loaded.

        Example:
            >>> lemonkit.Client().unload()
        """
        answer: dict[str, Any] = yield Request("POST", "unload", {"json": {"model_name": name} if name else {}})
        return answer

    @call
    def cache_info(self) -> Steps[dict[str, Any]]:
        """The server's answer cache for you (``GET /v1/cache``): ``entries``, ``bytes``, ``max_bytes``, and
        ``hits`` and ``misses`` since the server started. Deterministic requests (greedy or seeded) that ask for it,
        and every batch's, are answered from it when asked again.

        Example:
            >>> lemonkit.Client().cache_info()["entries"]
        """
        answer: dict[str, Any] = yield Request("GET", "cache")
        return answer

    @call
    def cache_clear(self) -> Steps[dict[str, Any]]:
        """Empty your answer cache on the server (``DELETE /v1/cache``); ``deleted`` says how many answers went.

        Example:
            >>> lemonkit.Client().cache_clear()
        """
        answer: dict[str, Any] = yield Request("DELETE", "cache")
        return answer

    @call
    def cancel_batch(self, batch_id: str) -> Steps[dict[str, Any]]:
        """Cancel a batch on the server (``POST /v1/batches/{id}/cancel``): its requests in flight stop, the finished
        ones stay in its output (and in the answer cache). An interrupted :func:`lemonkit.map` names its batch.

        Example:
            >>> lemonkit.Client().cancel_batch("batch_abc123")["status"]
            'cancelling'
        """
        answer: dict[str, Any] = yield Request("POST", f"batches/{batch_id}/cancel")
        return answer

    @call
    def delete(self, name: str) -> Steps[dict[str, Any]]:
        """Delete a model's downloaded files (``POST /v1/delete``).

        Raises:
            ModelNotFound: ``name`` is not registered.
        """
        answer: dict[str, Any] = yield Request("POST", "delete", {"json": {"model_name": name}})
        return answer

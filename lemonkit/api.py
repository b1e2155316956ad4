"""The notebook-facing functions (``lemonkit.pull``, ...), all on one shared :class:`~lemonkit.client.Client`."""

from __future__ import annotations

import threading
from typing import IO, Any

from lemonkit.client import Client, Event
from lemonkit.errors import DownloadError, error_from_body

__all__ = ["default_client", "pull"]

_lock = threading.Lock()
_client: Client | None = None


def default_client() -> Client:
    """The client the module-level functions use: it finds (or starts) its server at its first request."""
    global _client
    with _lock:
        if _client is None:
            _client = Client()
        return _client


def pull(
    model: str,
    *,
    checkpoint: str | None = None,
    recipe: str = "llamacpp",
    mmproj: str | None = None,
    reasoning: bool = False,
    vision: bool = False,
    embedding: bool = False,
    reranking: bool = False,
    progress: bool = True,
    file: IO[str] | None = None,
    client: Client | None = None,
) -> dict[str, Any]:
    """Download a model into the Hugging Face cache, with a progress bar.

    The download is the server's: interrupting this call pauses it, and pulling again resumes it.

    Args:
        model: A registered name (``"Qwen3-0.6B-GGUF"``), ``user.<name>`` with ``checkpoint`` to register one, or
            ``owner/repo[:variant]`` to register a hub repo under the name, labels and projector the hub suggests.
        checkpoint: Register ``model`` on ``repo:variant`` (or ``repo:file``).
        recipe: The recipe of a registration.
        mmproj: The vision projector file of a registration.
        reasoning: Label a registration ``reasoning``.
        vision: Label a registration ``vision``.
        embedding: Label a registration ``embeddings``.
        reranking: Label a registration ``reranking``.
        progress: Show a tqdm bar (a widget in notebooks that have ipywidgets).
        file: Where the bar is written (default: stderr).
        client: The client to use (default: :func:`default_client`).

    Returns:
        The model's ``/v1/models`` entry, now downloaded.

    Raises:
        ModelNotFound: ``model`` is not registered (and names no repo).
        InvalidRequest: The registration is refused.
        DownloadError: The hub or the network failed; pulling again resumes.
        ServerUnavailable: No server could be reached or started.
    """
    from tqdm.auto import tqdm

    client = client or default_client()
    flags = {"reasoning": reasoning, "vision": vision, "embedding": embedding, "reranking": reranking}
    body = client.pull_request(model, checkpoint=checkpoint, recipe=recipe, mmproj=mmproj, flags=flags)
    name = body["model_name"]
    bar = _notebook_bar(name, client) if progress and file is None else None
    if bar is None:
        bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=name, file=file, disable=not progress)
    with bar:
        for event in client.events("pull", body):
            if _advance(bar, event):
                return client.model(name)
    raise DownloadError(f"The server ended the pull of {name} before it finished")


def _notebook_bar(name: str, client: Client) -> Any:
    """A :class:`~lemonkit.widgets.DownloadBar` in a notebook, else ``None`` (a tqdm bar then)."""
    try:
        from lemonkit.widgets.download import notebook_bar
    except ImportError:  # no anywidget: tqdm
        return None
    return notebook_bar(name, client)


def _advance(bar: Any, event: Event) -> bool:
    """Show one pull event; ``True`` once the download is complete."""
    data = event.data
    if event.name == "progress":
        bar.total = data.get("total_download_size") or bar.total
        bar.n = data.get("cumulative_bytes_downloaded", bar.n)
        bar.set_postfix_str(f"{data['file_index']}/{data['total_files']} {data['file']}", refresh=False)
        bar.refresh()
    elif event.name == "complete":
        bar.n = bar.total
        bar.refresh()
        return True
    elif event.name == "error":
        error = data if isinstance(data, dict) else {"error": data}
        raise error_from_body(None, {"error": {"message": error.get("error"), "code": error.get("code")}})
    return False

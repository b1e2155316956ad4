"""The notebook-facing functions (``lemonkit.chat``, ``lemonkit.pull``, ...), all on one shared
:class:`~lemonkit.client.Client`: each runs that client's call of the same name (same steps, same arguments, same
doc; see :func:`on_default_client`), and ``pull`` adds a progress bar."""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, ParamSpec, TypeVar

from lemonkit import _LAZY
from lemonkit.client import Client, Event, default_client
from lemonkit.client.audio_calls import AudioCalls
from lemonkit.client.calls import call
from lemonkit.client.chat_calls import ChatCalls
from lemonkit.client.image_calls import ImageCalls
from lemonkit.client.model_calls import ModelCalls
from lemonkit.errors import DownloadError, error_from_body

if TYPE_CHECKING:
    import openai

#: the names the root takes from here (listed in ``lemonkit/__init__.py``, so that ``import lemonkit`` need not
#: import this module to know them)
__all__ = [name for name, (module, _) in _LAZY.items() if module == __name__]

P = ParamSpec("P")
T = TypeVar("T")


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
    remote_url: str | None = None,
    remote_urls: list[str] | None = None,
    api_key_env: str | None = None,
    progress: bool = True,
    file: IO[str] | None = None,
    client: Client | None = None,
) -> dict[str, Any]:
    """Download a model into the Hugging Face cache, with a progress bar; or register a model served elsewhere.

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
        remote_url: Register ``model`` (``user.<name>``) as served by this upstream (its OpenAI base URL, e.g. a
            vLLM server's ``http://host:8000/v1``); ``checkpoint`` is then the upstream's model id. Nothing
            downloads.
        remote_urls: Several upstreams of the same model, balanced, with failover.
        api_key_env: The server's environment variable (or secrets file entry) holding the upstream's key.
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
    remote = {"remote_url": remote_url, "remote_urls": remote_urls, "api_key_env": api_key_env}
    body = client.pull_request(model, checkpoint=checkpoint, recipe=recipe, mmproj=mmproj, flags=flags, **remote)
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
        from lemonkit.widgets.download_bar import notebook_bar
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


# -- the client's calls on the default client ----------------------------------------------------------------------


def on_default_client(method: call[P, T]) -> Callable[P, T]:
    """The module function of a client call: the same steps, run on :func:`default_client` (same arguments, same
    doc, its examples written ``lemonkit.chat(...)``)."""

    def function(*args: P.args, **kwargs: P.kwargs) -> T:
        client = default_client()
        return client._run(method.steps(client, *args, **kwargs))

    function.__name__ = function.__qualname__ = method.__name__
    function.__doc__ = (method.__doc__ or "").replace("lemonkit.Client().", "lemonkit.")
    function.__signature__ = method.signature  # type: ignore[attr-defined]
    return function


health = on_default_client(ModelCalls.health)
load = on_default_client(ModelCalls.load)
unload = on_default_client(ModelCalls.unload)
cache_info = on_default_client(ModelCalls.cache_info)
cache_clear = on_default_client(ModelCalls.cache_clear)
cancel_batch = on_default_client(ModelCalls.cancel_batch)
chat = on_default_client(ChatCalls.chat)
complete = on_default_client(ChatCalls.complete)
structured = on_default_client(ChatCalls.structured)
embed = on_default_client(ChatCalls.embed)
rerank = on_default_client(ChatCalls.rerank)
models = on_default_client(ChatCalls.models)
stats = on_default_client(ChatCalls.stats)
transcribe = on_default_client(AudioCalls.transcribe)
align = on_default_client(AudioCalls.align)
speak = on_default_client(AudioCalls.speak)
voices = on_default_client(AudioCalls.voices)
voice_chat = on_default_client(AudioCalls.voice_chat)
generate_image = on_default_client(ImageCalls.generate_image)
edit_image = on_default_client(ImageCalls.edit_image)
vary_image = on_default_client(ImageCalls.vary_image)
upscale = on_default_client(ImageCalls.upscale)


# -- other OpenAI clients ------------------------------------------------------------------------------------------


def openai_url(client: Client | None = None) -> str:
    """The OpenAI base URL of the server lemonkit uses here (finding or starting it first).

    In a Jupyter kernel that is the Jupyter server's ``{base_url}lemonkit/api/v1`` (JupyterHub's
    ``/user/<name>/lemonkit/api/v1`` included); else ``LEMONKIT_URL``'s, a running ``lemonkit serve``'s or the
    embedded server's ``.../api/v1``.

    Args:
        client: Whose server (default: :func:`default_client`).

    Returns:
        The URL, ending ``/api/v1``.

    Raises:
        ServerUnavailable: No server could be reached or started.

    Example:
        >>> lemonkit.openai_url()
        'http://127.0.0.1:8888/lemonkit/api/v1'
    """
    return (client or default_client()).server.api


def openai_client(client: Client | None = None, **kwargs: Any) -> openai.OpenAI:
    """An ``openai.OpenAI`` for the server lemonkit uses here: :func:`openai_url` with its key or Jupyter token.

    Args:
        client: Whose server (default: :func:`default_client`).
        **kwargs: More ``openai.OpenAI`` arguments (``timeout``, ``max_retries``, ...).

    Returns:
        The configured client.

    Raises:
        ImportError: The ``openai`` package is not installed.
        ServerUnavailable: No server could be reached or started.

    Example:
        >>> oai = lemonkit.openai_client()
        >>> oai.chat.completions.create(model="Gemma-3-270m-GGUF", messages=[{"role": "user", "content": "Hi"}])
    """
    import openai

    server = (client or default_client()).server
    return openai.OpenAI(base_url=server.api, api_key=server.token or "none", **kwargs)


def async_openai_client(client: Client | None = None, **kwargs: Any) -> openai.AsyncOpenAI:
    """:func:`openai_client`'s ``openai.AsyncOpenAI`` twin."""
    import openai

    server = (client or default_client()).server
    return openai.AsyncOpenAI(base_url=server.api, api_key=server.token or "none", **kwargs)

"""The notebook-facing functions (``lemonkit.chat``, ``lemonkit.pull``, ...), all on one shared
:class:`~lemonkit.client.Client`: each is that client's method of the same name (same arguments, same doc)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any, TypeVar

from lemonkit.api_requests import Embeddings, Messages
from lemonkit.audio_methods import AudioInput
from lemonkit.client import Client, Event, default_client
from lemonkit.errors import DownloadError, error_from_body
from lemonkit.image_methods import Size
from lemonkit.images import ImageInput, Images
from lemonkit.results import ChatResult, ModelList, Ranking
from lemonkit.speech import Speech
from lemonkit.transcripts import Transcript
from lemonkit.voice_chat_reply import VoiceChatOptions, VoiceChatReply

if TYPE_CHECKING:
    from typing import Unpack

    import openai

__all__ = [
    "align",
    "async_openai_client",
    "chat",
    "complete",
    "default_client",
    "edit_image",
    "embed",
    "generate_image",
    "health",
    "load",
    "models",
    "openai_client",
    "openai_url",
    "pull",
    "rerank",
    "speak",
    "stats",
    "structured",
    "transcribe",
    "unload",
    "upscale",
    "vary_image",
    "voice_chat",
    "voices",
]

_F = TypeVar("_F", bound=Callable[..., Any])


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


# -- the client's methods on the default client --------------------------------------------------------------------


def _doc_of(method: Callable[..., Any]) -> Callable[[_F], _F]:
    def document(function: _F) -> _F:
        function.__doc__ = (method.__doc__ or "").replace("lemonkit.Client().", "lemonkit.")
        return function

    return document


@_doc_of(Client.chat)
def chat(
    prompt_or_messages: Messages,
    model: str | None = None,
    *,
    stream: bool = True,
    system: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    response_format: dict[str, Any] | None = None,
    **sampling: Any,
) -> ChatResult:
    return default_client().chat(
        prompt_or_messages,
        model,
        stream=stream,
        system=system,
        tools=tools,
        response_format=response_format,
        **sampling,
    )


@_doc_of(Client.complete)
def complete(prompt: str, model: str | None = None, *, stream: bool = True, **sampling: Any) -> ChatResult:
    return default_client().complete(prompt, model, stream=stream, **sampling)


@_doc_of(Client.structured)
def structured(prompt: Messages, schema: Any, model: str | None = None, **sampling: Any) -> Any:
    return default_client().structured(prompt, schema, model, **sampling)


@_doc_of(Client.embed)
def embed(texts: str | Sequence[str], model: str | None = None) -> Embeddings:
    return default_client().embed(texts, model)


@_doc_of(Client.rerank)
def rerank(query: str, documents: Sequence[str], model: str | None = None) -> Ranking:
    return default_client().rerank(query, documents, model)


@_doc_of(Client.models)
def models(all: bool = False) -> ModelList:
    return default_client().models(all)


@_doc_of(Client.load)
def load(name: str, **options: Any) -> dict[str, Any]:
    return default_client().load(name, **options)


@_doc_of(Client.unload)
def unload(name: str | None = None) -> dict[str, Any]:
    return default_client().unload(name)


@_doc_of(Client.health)
def health() -> dict[str, Any]:
    return default_client().health()


@_doc_of(Client.stats)
def stats() -> dict[str, Any]:
    return default_client().stats()


@_doc_of(Client.transcribe)
def transcribe(
    audio: AudioInput,
    model: str | None = None,
    *,
    sample_rate: int | None = None,
    language: str | None = None,
    prompt: str | None = None,
    temperature: float | None = None,
    words: bool = True,
) -> Transcript:
    return default_client().transcribe(
        audio,
        model,
        sample_rate=sample_rate,
        language=language,
        prompt=prompt,
        temperature=temperature,
        words=words,
    )


@_doc_of(Client.align)
def align(
    audio: AudioInput,
    text: str,
    model: str | None = None,
    *,
    sample_rate: int | None = None,
    language: str | None = None,
) -> Transcript:
    return default_client().align(audio, text, model, sample_rate=sample_rate, language=language)


@_doc_of(Client.speak)
def speak(text: str, model: str | None = None, *, voice: str | None = None, speed: float = 1.0) -> Speech:
    return default_client().speak(text, model, voice=voice, speed=speed)


@_doc_of(Client.voices)
def voices(model: str | None = None) -> list[str]:
    return default_client().voices(model)


@_doc_of(Client.voice_chat)
def voice_chat(question: AudioInput, **options: Unpack[VoiceChatOptions]) -> VoiceChatReply:
    return default_client().voice_chat(question, **options)


@_doc_of(Client.generate_image)
def generate_image(
    prompt: str,
    model: str | None = None,
    *,
    n: int = 1,
    size: Size | None = None,
    steps: int | None = None,
    cfg_scale: float | None = None,
    seed: int | None = None,
) -> Images:
    return default_client().generate_image(prompt, model, n=n, size=size, steps=steps, cfg_scale=cfg_scale, seed=seed)


@_doc_of(Client.edit_image)
def edit_image(
    image: ImageInput | list[ImageInput],
    prompt: str,
    mask: ImageInput | None = None,
    model: str | None = None,
    *,
    n: int = 1,
    size: Size | None = None,
    steps: int | None = None,
    cfg_scale: float | None = None,
    seed: int | None = None,
) -> Images:
    return default_client().edit_image(
        image, prompt, mask, model, n=n, size=size, steps=steps, cfg_scale=cfg_scale, seed=seed
    )


@_doc_of(Client.vary_image)
def vary_image(
    image: ImageInput, model: str | None = None, *, n: int = 1, size: Size | None = None, seed: int | None = None
) -> Images:
    return default_client().vary_image(image, model, n=n, size=size, seed=seed)


@_doc_of(Client.upscale)
def upscale(image: ImageInput, model: str | None = None, *, factor: int | None = None) -> Images:
    return default_client().upscale(image, model, factor=factor)


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

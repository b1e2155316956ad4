"""The jupyter-server extension: every route under ``{base_url}lemonkit/``, behind Jupyter's auth."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jupyter_server.base.handlers import APIHandler
from jupyter_server.base.handlers import JupyterHandler as JupyterBaseHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web, websocket
from traitlets import Bool, Int, List, Unicode, default

from lemonkit.catalog.config import LiveLimits, RemoteSettings, Settings, UserLimits
from lemonkit.catalog.placement import parse_size
from lemonkit.catalog.recipe_table import load_recipes
from lemonkit.errors import Unauthorized
from lemonkit.server import batches, forward, routes
from lemonkit.server.service import SETTINGS_KEY, Service
from lemonkit.serving import hub_discovery

__all__ = ["JupyterHandler", "JupyterWebSocketHandler", "LemonkitExtension"]

_MISSING = "Jupyter credentials are required: send 'Authorization: Bearer <jupyter token>'"


class _RequireUser:
    """Jupyter's own ``prepare`` identifies the user; refuse (401) when there is none, whatever the server's
    ``allow_unauthenticated_access``."""

    current_user: Any
    check_host: Callable[[], bool]

    async def prepare(self) -> None:
        required = getattr(self, "auth_required", True)
        try:
            await super().prepare()  # type: ignore[misc]
        except web.HTTPError as exc:
            # Jupyter answers a request without credentials 403 (XSRF or login); say what is missing instead,
            # unless its Host check refused the request (a DNS-rebinding page): that stays a 403
            if exc.status_code == 403 and required and self.current_user is None and self.check_host():
                raise Unauthorized(_MISSING) from None
            raise
        if required and self.current_user is None:
            raise Unauthorized(_MISSING)


class JupyterHandler(ExtensionHandlerMixin, _RequireUser, APIHandler):  # type: ignore[misc]
    """Host base: Jupyter's identity (token, ``Authorization: Bearer``, XSRF for browsers) on every route but live."""


class JupyterWebSocketHandler(  # type: ignore[misc]
    ExtensionHandlerMixin, _RequireUser, WebSocketMixin, websocket.WebSocketHandler, JupyterBaseHandler
):
    """Host base of the WebSocket routes, combined as jupyter_server's own kernel WebSocket is: its identity
    (``?token=`` or the Authorization header) checked before the upgrade, its origin check and pings."""


class LemonkitExtension(ExtensionApp):
    """Serves the Lemonade / OpenAI API from inside Jupyter."""

    name = "lemonkit"
    load_other_extensions = True

    cache_dir = Unicode(help="lemonkit's cache dir (default: $LEMONADE_CACHE_DIR or ~/.cache/lemonkit)").tag(
        config=True
    )
    max_loaded_models = Int(help="A fixed count of models kept loaded per type (-1: none, memory decides)").tag(
        config=True
    )
    # memory; None: $LEMONKIT_..., else the machine's
    memory = Unicode(
        None, allow_none=True, help="Host memory lemonkit's models may take in all, e.g. 8GiB (default: the machine's)"
    ).tag(config=True)
    gpu_memory = Unicode(
        None, allow_none=True, help="GPU memory lemonkit's models may take in all, e.g. 6GiB (default: the device's)"
    ).tag(config=True)
    llamacpp_backend = Unicode(
        None,
        allow_none=True,
        help="The llama.cpp build models run on unless they name one (default: the best installed)",
    ).tag(config=True)
    llamacpp_args = Unicode(help="Default llama.cpp flags for every llamacpp model").tag(config=True)
    recipes_file = Unicode(help="JSON recipe/backend rows merged over lemonkit's own (default: $LEMONKIT_RECIPES)").tag(
        config=True
    )
    pip_command = List(Unicode(), help="The pip that installs backends (default: this Python's)").tag(config=True)
    # bounds of /v1/audio/transcriptions/live's body (0: none); None: $LEMONKIT_LIVE_..., else lemonkit's default
    live_idle_timeout_ms = Int(None, allow_none=True, help="Longest wait for more live audio, in ms").tag(config=True)
    live_total_timeout_ms = Int(None, allow_none=True, help="Longest live body, in ms").tag(config=True)
    live_max_body_bytes = Int(None, allow_none=True, help="Largest live body, framing included").tag(config=True)
    live_max_chunk_bytes = Int(None, allow_none=True, help="Largest chunk of a live body (more than 0)").tag(
        config=True
    )
    # per-user limits of the model requests (0: none); None: $LEMONKIT_USER_..., else 0
    user_max_active = Int(None, allow_none=True, help="A user's model requests under way at once").tag(config=True)
    user_max_queued = Int(None, allow_none=True, help="A user's model requests waiting for a turn").tag(config=True)
    user_rate = Int(None, allow_none=True, help="A user's model requests per minute").tag(config=True)
    # back-pressure; None: $LEMONKIT_MAX_QUEUE, else lemonkit's default
    max_queue = Int(
        None, allow_none=True, help="Model requests (all users) that may wait at one model; more get 503 (0: no bound)"
    ).tag(config=True)

    # a single-user server of a JupyterHub can hand everything to the hub's shared service instead
    forward_to_hub = Bool(
        help="Forward every lemonkit route to the JupyterHub's lemonkit service, with this server's hub token, "
        "instead of loading models here (default: $LEMONKIT_FORWARD_TO_HUB)"
    ).tag(config=True)
    hub_service = Unicode(
        help="The JupyterHub service to forward to (default: $LEMONKIT_HUB_SERVICE, else lemonkit)"
    ).tag(config=True)

    @default("forward_to_hub")
    def _forward_default(self) -> bool:
        return os.environ.get(hub_discovery.FORWARD_ENV, "").strip().lower() in ("1", "true", "yes", "on")

    @default("hub_service")
    def _hub_service_default(self) -> str:
        return os.environ.get(hub_discovery.SERVICE_ENV, "").strip() or hub_discovery.DEFAULT_SERVICE

    # the remote recipe: None -> $LEMONKIT_REMOTE_ALLOWED_HOSTS, else any host (a personal server)
    remote_allowed_hosts = List(
        Unicode(), default_value=None, allow_none=True, help="Hosts remote models may name ('.domain', '*')"
    ).tag(config=True)
    secrets_file = Unicode(help="JSON or dotenv file of upstream keys (default: $LEMONKIT_SECRETS_FILE)").tag(
        config=True
    )

    @default("cache_dir")
    def _cache_dir_default(self) -> str:
        return str(Settings().cache_dir)

    @default("max_loaded_models")
    def _max_loaded_default(self) -> int:
        return Settings().max_loaded_models

    @default("llamacpp_args")
    def _llamacpp_args_default(self) -> str:
        return Settings().llamacpp_args

    @default("recipes_file")
    def _recipes_file_default(self) -> str:
        return os.environ.get("LEMONKIT_RECIPES", "")

    @default("pip_command")
    def _pip_command_default(self) -> list[str]:
        return list(Settings().pip_command)

    def initialize_settings(self) -> None:
        if self.forward_to_hub:
            self._initialize_forwarding()
            return
        settings = Settings(
            cache_dir=Path(self.cache_dir),
            max_loaded_models=self.max_loaded_models,
            llamacpp_args=self.llamacpp_args,
            recipes=load_recipes(self.recipes_file or None),
            pip_command=tuple(self.pip_command),
            live_limits=LiveLimits.from_env(**{name: getattr(self, "live_" + name) for name in LiveLimits.ENV}),
            remote=self._remote_settings(),
            user_limits=UserLimits.from_env(**{name: getattr(self, "user_" + name) for name in UserLimits.ENV}),
        )
        if self.max_queue is not None:
            settings = dataclasses.replace(settings, max_queue=self.max_queue)
        if self.memory is not None:
            settings = dataclasses.replace(settings, memory=parse_size(self.memory))
        if self.gpu_memory is not None:
            settings = dataclasses.replace(settings, gpu_memory=parse_size(self.gpu_memory))
        if self.llamacpp_backend is not None:
            settings = dataclasses.replace(settings, llamacpp_backend=self.llamacpp_backend or None)
        settings.api_key = None  # Jupyter's own auth guards every route
        self.service = Service(settings)
        self.settings.update({SETTINGS_KEY: self.service})
        batches.start(self.service)

    def _initialize_forwarding(self) -> None:
        hub = hub_discovery.HubEnvironment.from_env(required=True)
        if hub is None:
            raise RuntimeError(
                "LemonkitExtension.forward_to_hub is set, but this server is not a JupyterHub single-user server "
                "(JUPYTERHUB_API_URL and JUPYTERHUB_API_TOKEN are not set)"
            )
        self.upstream = forward.Upstream(dataclasses.replace(hub, service=self.hub_service))
        self.settings.update({forward.UPSTREAM_KEY: self.upstream})
        self.log.info("lemonkit forwards to the JupyterHub service %r", self.hub_service)

    def _remote_settings(self) -> RemoteSettings:
        settings = RemoteSettings()
        if self.remote_allowed_hosts is not None:
            settings = dataclasses.replace(settings, allowed_hosts=tuple(self.remote_allowed_hosts))
        if self.secrets_file:
            settings = dataclasses.replace(settings, secrets_file=Path(self.secrets_file).expanduser())
        return settings

    def initialize_handlers(self) -> None:
        build = forward.build if self.forward_to_hub else routes.build
        self.handlers.extend(build("lemonkit/", JupyterHandler, JupyterWebSocketHandler))

    async def stop_extension(self) -> None:
        if self.forward_to_hub:
            await self.upstream.aclose()
        else:
            await self.service.close()

"""The jupyter-server extension: every route under ``{base_url}lemonkit/``, behind Jupyter's auth."""

from __future__ import annotations

from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web
from traitlets import Int, Unicode, default

from lemonkit.config import Settings
from lemonkit.errors import Unauthorized
from lemonkit.server import routes
from lemonkit.server.service import SETTINGS_KEY, Service

__all__ = ["JupyterHandler", "LemonkitExtension"]

_MISSING = "Jupyter credentials are required: send 'Authorization: Bearer <jupyter token>'"


class JupyterHandler(ExtensionHandlerMixin, APIHandler):
    """Host base: Jupyter's identity (token, ``Authorization: Bearer``, XSRF for browsers) on every route but live."""

    async def prepare(self) -> None:  # type: ignore[override]
        required = getattr(self, "auth_required", True)
        try:
            await super().prepare()
        except web.HTTPError as exc:
            # Jupyter answers a request without credentials 403 (XSRF or login); say what is missing instead
            if exc.status_code == 403 and required and self.current_user is None:
                raise Unauthorized(_MISSING) from None
            raise
        if required and self.current_user is None:
            raise Unauthorized(_MISSING)


class LemonkitExtension(ExtensionApp):
    """Serves the Lemonade / OpenAI API from inside Jupyter."""

    name = "lemonkit"
    load_other_extensions = True

    cache_dir = Unicode(help="lemonkit's cache dir (default: $LEMONADE_CACHE_DIR or ~/.cache/lemonkit)").tag(
        config=True
    )
    max_loaded_models = Int(help="Models kept loaded per type; -1 for no limit").tag(config=True)
    llamacpp_args = Unicode(help="Default llama.cpp flags for every llamacpp model").tag(config=True)

    @default("cache_dir")
    def _cache_dir_default(self) -> str:
        return str(Settings().cache_dir)

    @default("max_loaded_models")
    def _max_loaded_default(self) -> int:
        return Settings().max_loaded_models

    @default("llamacpp_args")
    def _llamacpp_args_default(self) -> str:
        return Settings().llamacpp_args

    def initialize_settings(self) -> None:
        from pathlib import Path

        settings = Settings(
            cache_dir=Path(self.cache_dir), max_loaded_models=self.max_loaded_models, llamacpp_args=self.llamacpp_args
        )
        settings.api_key = None  # Jupyter's own auth guards every route
        self.service = Service(settings)
        self.settings.update({SETTINGS_KEY: self.service})

    def initialize_handlers(self) -> None:
        self.handlers.extend(routes.build("lemonkit/", JupyterHandler))

    async def stop_extension(self) -> None:
        await self.service.close()

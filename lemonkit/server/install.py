"""``POST /v1/install`` and ``POST /v1/uninstall``: a recipe backend's package, through pip.

``stream=true`` answers with SSE events named like ``/v1/pull``'s: one ``progress`` per line
pip prints (``line``, plus pull's ``file``/``file_index``/``total_files``/``percent`` so a
pull progress view can show it; a llama.cpp build's ``percent`` follows its compile steps),
then ``complete`` with the backend's new state, or ``error``. Bad arguments, an unsupported
backend and a build's missing prerequisites are refused with a plain JSON error before the
stream starts. pip is never interrupted by a client that leaves: a half-done install would
leave the environment broken.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

from tornado.concurrent import Future

from lemonkit.errors import LemonkitError
from lemonkit.formats import sse
from lemonkit.server.handler import LemonkitHandler
from lemonkit.serving.installer import LineSink

__all__ = ["InstallHandler", "UninstallHandler"]

log = logging.getLogger("lemonkit.server")


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    return sse.frame(data, name)


def _retrieve(future: Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # a client that left makes flushes fail; that is expected, not worth a log line


class _BackendHandler(LemonkitHandler):
    async def check(self, body: dict[str, Any]) -> None:
        """Refuse the request before anything runs (so a stream never starts for a bad one)."""
        raise NotImplementedError

    def run(self, body: dict[str, Any], on_line: LineSink | None) -> Awaitable[dict[str, Any]]:
        raise NotImplementedError

    async def post(self) -> None:
        self.require_admin("installing or uninstalling a backend")
        body = self.json_body()
        recipe, backend = body["recipe"], body["backend"]
        await self.check(body)
        if not body.get("stream"):
            await self.run(body, None)
            self.write_json({"status": "success", "recipe": recipe, "backend": backend})
            return
        target = {
            "recipe": recipe,
            "backend": backend,
            "file": f"{recipe}:{backend}",
            "file_index": 1,
            "total_files": 1,
        }
        await self.sse_open()

        percent = 0

        def on_line(line: str, at: int | None) -> None:
            # pip's output is finite and small, so lines are written without waiting for a slow client
            nonlocal percent
            percent = max(percent, at or 0)
            if not self._client_gone:
                self.write(sse_event("progress", {**target, "percent": percent, "line": line}))
                self.flush().add_done_callback(_retrieve)

        try:
            status = await self.run(body, on_line)
        except Exception as exc:
            if isinstance(exc, LemonkitError):
                err = exc
            else:
                log.exception("%s %s failed", self.request.method, self.request.path)
                err = LemonkitError("The request failed unexpectedly; see the server log", code="internal_error")
            error = {"message": err.message, "type": err.type, "code": err.code, "status_code": err.status}
            self.write(sse_event("error", {"error": error}))
        else:
            done = {**target, "percent": 100, "status": "success", "state": status["state"]}
            self.write(sse_event("complete", {**done, "version": status.get("version")}))
        self.finish()


class InstallHandler(_BackendHandler):
    schema = "install"

    async def check(self, body: dict[str, Any]) -> None:
        await self.service.installer.check_install(body["recipe"], body["backend"], force=bool(body.get("force")))

    def run(self, body: dict[str, Any], on_line: LineSink | None) -> Awaitable[dict[str, Any]]:
        installer = self.service.installer
        return installer.install(body["recipe"], body["backend"], force=bool(body.get("force")), on_line=on_line)


class UninstallHandler(_BackendHandler):
    schema = "uninstall"

    async def check(self, body: dict[str, Any]) -> None:
        self.service.installer.check_uninstall(body["recipe"], body["backend"])

    def run(self, body: dict[str, Any], on_line: LineSink | None) -> Awaitable[dict[str, Any]]:
        return self.service.installer.uninstall(body["recipe"], body["backend"], on_line=on_line)

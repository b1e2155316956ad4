"""What every lemonkit widget shares: its client, an error banner, and front-end actions run in the background.

The browser never talks to a server: it sends ``{"action": name, "args": [...]}`` and the kernel does the work
through :class:`lemonkit.Client` on a thread, reporting back through traitlets (so a reloaded tab, which renders
the kernel's state again, sees the same thing).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar, TypeVar

import anywidget
import traitlets

from lemonkit.client import Client
from lemonkit.errors import InvalidRequest, LemonkitError
from lemonkit.widgets.assets import css
from lemonkit.widgets.picker import choices

__all__ = ["Panel", "TaskPanel", "error_of", "spawn"]

T = TypeVar("T")


def error_of(exc: BaseException) -> dict[str, Any]:
    """An exception as the error banner shows it."""
    if isinstance(exc, LemonkitError):
        return {"message": exc.message, "code": exc.code}
    return {"message": str(exc) or type(exc).__name__, "code": type(exc).__name__}


def spawn(fn: Callable[..., T], *args: Any) -> Future[T]:
    """Run ``fn(*args)`` on a daemon thread (a long pull never holds up the interpreter's exit)."""
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=f"lemonkit widget {getattr(fn, '__name__', fn)}", daemon=True).start()
    return future


class Panel(anywidget.AnyWidget):
    """Base of the lemonkit widgets.

    Args:
        client: The client doing the work (default: :func:`lemonkit.default_client`).
    """

    _css = css()
    #: the global error banner: ``{"message", "code"}`` or ``None``
    error = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    #: the methods the front end may call
    actions: ClassVar[frozenset[str]] = frozenset({"dismiss"})
    #: those of them that take the message's binary buffers (as a list of ``bytes``) after their arguments
    binary_actions: ClassVar[frozenset[str]] = frozenset()
    #: synced traits the page may send along with an action (``actWith`` in shared.js), applied before it runs
    page_fields: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, *, client: Client | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._client = client
        self._lock = threading.RLock()  # read-modify-write of dict traitlets from worker threads
        self.on_msg(self._on_message)

    @property
    def client(self) -> Client:
        if self._client is None:
            from lemonkit.api import default_client

            self._client = default_client()
        return self._client

    def _on_message(self, _widget: Any, content: Any, buffers: Any) -> None:
        action = content.get("action") if isinstance(content, dict) else None
        args = content.get("args", []) if isinstance(content, dict) else []
        if action not in self.actions or not isinstance(args, list):
            self.error = {"message": f"unknown widget action {action!r}", "code": "invalid_argument"}
            return
        if action in self.binary_actions:
            args = [*args, [bytes(b) for b in buffers or ()]]
        try:
            self._apply_page_fields(content.get("state"))
            getattr(self, action)(*args)
        except Exception as exc:  # a bad argument from the page: say so, never kill the comm
            self.show_error(exc)

    def _apply_page_fields(self, state: Any) -> None:
        # ipywidgets holds a model's updates back while an earlier one is unanswered, but not custom messages: the
        # page's latest field values travel with the action, so it never runs on stale ones
        if not isinstance(state, dict):
            return
        with self.hold_sync():
            for name, value in state.items():
                if name in self.page_fields:
                    setattr(self, name, value)

    def background(
        self, fn: Callable[..., T], *args: Any, on_error: Callable[[BaseException], None] | None = None
    ) -> Future[T]:
        """Run ``fn(*args)`` off the kernel's thread; an exception shows in the banner (or ``on_error``) and in
        the returned future."""

        def task() -> T:
            try:
                return fn(*args)
            except Exception as exc:
                (on_error or self.show_error)(exc)
                raise

        return spawn(task)

    def show_error(self, exc: BaseException) -> None:
        self.error = error_of(exc)

    def dismiss(self) -> None:
        """Hide the error banner."""
        self.set_trait("error", None)

    def update_entry(self, trait: str, key: str, value: Any) -> None:
        """Set (or with ``None`` drop) ``key`` of the dict traitlet ``trait``, syncing a new dict."""
        with self._lock:
            current = dict(getattr(self, trait))
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
            setattr(self, trait, current)


class TaskPanel(Panel):
    """A panel with a model picker of one task (``task``: a deployment label such as ``tts``) and a busy flag.

    Args:
        client: The client doing the work (default: :func:`lemonkit.default_client`).
        model: The model picked first (default: a loaded one, else the first downloaded one).

    Attributes:
        ready: The future of the first read of the models.
    """

    task: ClassVar[str]
    models = traitlets.List(traitlets.Unicode()).tag(sync=True)
    model = traitlets.Unicode("").tag(sync=True)
    #: a request is under way
    busy = traitlets.Bool(False).tag(sync=True)

    def __init__(self, *, client: Client | None = None, model: str | None = None, **traits: Any) -> None:
        super().__init__(client=client, model=model or "", **traits)
        self.ready = self.refresh_models()

    def refresh_models(self) -> Future[None]:
        """Read the models the picker offers again."""
        return self.background(self.read_models)

    def read_models(self) -> None:
        models, preferred = choices(self.client, self.task)
        self.models = models
        if not self.model and preferred:
            self.model = preferred

    def _start(self, *, needs_model: bool = True) -> None:
        with self._lock:
            if self.busy:
                raise InvalidRequest("Still working on the last request")
            if needs_model and not self.model:
                raise InvalidRequest(f"No {self.task} model is downloaded: pull one (lemonkit.ModelBrowser)")
            self.dismiss()
            self.busy = True

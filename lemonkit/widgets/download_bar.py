"""``DownloadBar``: one model's download as a progress bar; what ``lemonkit.pull()`` shows in a notebook."""

from __future__ import annotations

import sys
from concurrent.futures import Future
from typing import Any, ClassVar

import traitlets

from lemonkit.client import Client
from lemonkit.widgets import progress
from lemonkit.widgets.assets import esm
from lemonkit.widgets.panel import Panel

__all__ = ["DownloadBar", "in_notebook", "notebook_bar"]


def in_notebook() -> bool:
    """Whether this runs in a kernel whose front end can show widgets (not plain ``python`` or terminal IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


class DownloadBar(Panel):
    """The download of ``model`` as a progress bar.

    :meth:`start` downloads in the background with pause and cancel buttons. :func:`lemonkit.pull` drives it
    through tqdm's protocol instead (``total``, ``n``, ``set_postfix_str``, ``refresh``, a context manager).

    Args:
        model: The model's name.
        client: The client doing the work (default: :func:`lemonkit.default_client`).

    Example:
        >>> bar = DownloadBar("Qwen3-0.6B-GGUF")
        >>> bar.start().result()["status"]
        'completed'
    """

    _esm = esm("download_bar")
    model_name = traitlets.Unicode().tag(sync=True)
    progress = traitlets.Dict().tag(sync=True)
    #: pause and cancel buttons (a background download's)
    controls = traitlets.Bool(False).tag(sync=True)
    actions: ClassVar[frozenset[str]] = frozenset({"pause", "cancel", "dismiss"})

    def __init__(self, model: str, *, client: Client | None = None) -> None:
        super().__init__(client=client, model_name=model, progress={**progress.STARTING, "status": "idle"})
        self._postfix = ""

    def start(self) -> Future[dict[str, Any]]:
        """Download (or resume) the model in the background; the future gives its last state."""
        self.controls = True

        def run() -> dict[str, Any]:
            try:
                self.progress = state = progress.start(self.client, self.model_name)
                if state["status"] in progress.ACTIVE:
                    state = progress.follow(self.client, self.model_name, state, self._report)
            finally:
                self.controls = False
            if state.get("error"):
                self.error = state["error"]
            return state

        return self.background(run)

    def pause(self) -> Future[dict[str, Any]]:
        return self.background(self._control, "pause")

    def cancel(self) -> Future[dict[str, Any]]:
        return self.background(self._control, "cancel")

    def _control(self, action: str) -> dict[str, Any]:
        self.progress = state = progress.control(self.client, self.model_name, action)
        return state

    def _report(self, state: dict[str, Any]) -> None:
        self.progress = state

    # -- tqdm's protocol, as lemonkit.pull drives a bar -------------------------------------------------------

    @property
    def total(self) -> int:
        return int(self.progress.get("total") or 0)

    @total.setter
    def total(self, value: int) -> None:
        self.progress = {**self.progress, "total": value or 0}

    @property
    def n(self) -> int:
        return int(self.progress.get("done") or 0)

    @n.setter
    def n(self, value: int) -> None:
        self.progress = {**self.progress, "done": value}

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self._postfix = s
        if refresh:
            self.refresh()

    def refresh(self) -> None:
        done, total = self.n, self.total
        complete = total > 0 and done >= total
        self.progress = {
            **self.progress,
            "status": "completed" if complete else "downloading",
            "percent": 100 if complete else (round(done * 100 / total, 1) if total else 0),
            "file": self._postfix,
        }

    def close(self) -> None:
        pass

    def __enter__(self) -> DownloadBar:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: object) -> None:
        if exc is None:
            return
        stopped = isinstance(exc, KeyboardInterrupt)  # interrupting lemonkit.pull pauses the server's download
        self.progress = {**self.progress, "status": "paused" if stopped else "error"}
        if not stopped:
            self.show_error(exc)


def notebook_bar(model: str, client: Client) -> DownloadBar | None:
    """A displayed :class:`DownloadBar` for ``model`` in a notebook; ``None`` elsewhere (a tqdm bar then)."""
    if not in_notebook():
        return None
    from IPython.display import display

    bar = DownloadBar(model, client=client)
    display(bar)
    return bar

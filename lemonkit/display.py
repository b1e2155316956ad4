"""Showing an answer while it streams: one updating display in a notebook, plain text on stdout elsewhere."""

from __future__ import annotations

import html
import sys
import time
from typing import Any, Protocol

__all__ = ["StreamView", "in_notebook", "stream_view"]

#: a notebook display is redrawn at most this often (each redraw sends the whole answer so far to the browser)
_REDRAW_INTERVAL = 0.1


class StreamView(Protocol):
    def add(self, content: str, reasoning: str) -> None: ...

    def close(self, *, interrupted: bool = False) -> None: ...


def in_notebook() -> bool:
    """Whether this runs in an IPython kernel that has a frontend to display to (not a terminal IPython)."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def stream_view() -> StreamView:
    """The view for this process: :class:`NotebookView` in a notebook, :class:`PlainView` elsewhere."""
    return NotebookView() if in_notebook() else PlainView()


class PlainView:
    """Writes tokens to stdout as they arrive; reasoning first, separated from the answer by a blank line."""

    def __init__(self) -> None:
        self._reasoning = False
        self._content = False

    def add(self, content: str, reasoning: str) -> None:
        out = sys.stdout
        if reasoning:
            self._reasoning = True
            out.write(reasoning)
        if content:
            if self._reasoning and not self._content:
                out.write("\n\n")
            self._content = True
            out.write(content)
        out.flush()

    def close(self, *, interrupted: bool = False) -> None:
        sys.stdout.write(" [interrupted]\n" if interrupted else "\n")
        sys.stdout.flush()


class NotebookView:
    """One display handle, redrawn as tokens arrive (throttled); Markdown once the answer is complete."""

    def __init__(self) -> None:
        from IPython.display import display

        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._drawn = 0.0
        self._handle: Any = display({"text/plain": ""}, raw=True, display_id=True)

    def add(self, content: str, reasoning: str) -> None:
        self._content.append(content)
        self._reasoning.append(reasoning)
        now = time.monotonic()
        if now - self._drawn >= _REDRAW_INTERVAL:
            self._drawn = now
            self._handle.update(self._streaming(), raw=True)

    def close(self, *, interrupted: bool = False) -> None:
        text, reasoning = "".join(self._content), "".join(self._reasoning)
        if interrupted:
            text += "\n\n*[interrupted]*"
        details = f"<details><summary>Reasoning</summary>\n\n{reasoning}\n\n</details>\n\n" if reasoning else ""
        self._handle.update({"text/markdown": details + text, "text/plain": text}, raw=True)

    def _streaming(self) -> dict[str, str]:
        text, reasoning = "".join(self._content), "".join(self._reasoning)
        block = '<div style="white-space: pre-wrap">{}</div>'
        details = ""
        if reasoning:
            details = f"<details><summary>Reasoning</summary>{block.format(html.escape(reasoning))}</details>"
        return {"text/html": details + block.format(html.escape(text)), "text/plain": text}

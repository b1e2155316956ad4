"""Showing an answer while it streams: one updating display in a notebook, plain text on stdout elsewhere."""

from __future__ import annotations

import html
import sys
import time
from typing import Any, Protocol

from lemonkit.catalog.omni.media import Media, split_media, strip_media

__all__ = ["StreamView", "in_notebook", "media_html", "stream_view"]

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
        rendered = media_html(text)
        if rendered is not None:  # an omni answer: its pictures and sounds shown and playable, not as base64
            summary = _reasoning_html(reasoning)
            self._handle.update({"text/html": summary + rendered, "text/plain": strip_media(text)}, raw=True)
            return
        self._handle.update({"text/markdown": details + text, "text/plain": text}, raw=True)

    def _streaming(self) -> dict[str, str]:
        text, reasoning = _without_media("".join(self._content)), "".join(self._reasoning)
        return {"text/html": _reasoning_html(reasoning) + _BLOCK.format(html.escape(text)), "text/plain": text}


_BLOCK = '<div style="white-space: pre-wrap">{}</div>'
#: how an image or a sound starts in an omni answer (see lemonkit.catalog.omni.media)
_MEDIA_STARTS = ("![generated image](data:", "<audio>data:")


def _reasoning_html(reasoning: str) -> str:
    return (
        f"<details><summary>Reasoning</summary>{_BLOCK.format(html.escape(reasoning))}</details>" if reasoning else ""
    )


def _without_media(text: str) -> str:
    """``text`` with its media as placeholders, and one still arriving cut off (not redrawn as base64)."""
    text = strip_media(text)
    start = max(text.rfind(m) for m in _MEDIA_STARTS)
    return text if start < 0 else text[:start] + "[…]"


def media_html(text: str) -> str | None:
    """An omni answer as HTML: its text, each image as an ``<img>``, each sound as a player (as
    :class:`~lemonkit.Images` and :class:`~lemonkit.Speech` show theirs); ``None`` when ``text`` holds no media."""
    pieces = split_media(text)
    if not any(isinstance(p, Media) for p in pieces):
        return None
    out = []
    for piece in pieces:
        if not isinstance(piece, Media):
            if piece.strip():
                out.append(_BLOCK.format(html.escape(piece.strip("\n"))))
        elif piece.kind == "image":
            out.append(
                f'<img src="data:{piece.mime};base64,{piece.b64}" alt="generated image" '
                'style="max-width: 100%; height: auto; display: block">'
            )
        else:
            out.append(f'<audio controls preload="auto" src="data:{piece.mime};base64,{piece.b64}"></audio>')
    return f'<div class="lk-omni">{"".join(out)}</div>'

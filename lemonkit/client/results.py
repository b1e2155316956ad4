"""What the Python API returns: :class:`ChatResult`, :class:`Ranking`, :class:`ModelList`.

A chat answer arrives either whole or as ``chat.completion.chunk`` objects; :class:`ChatAccumulator` folds either
into one :class:`ChatResult`, so the streamed and the non-streamed paths (sync and async) share one body.
"""

from __future__ import annotations

import html
import io
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lemonkit.catalog.omni.media import Media, find_media
from lemonkit.client.display import media_html

if TYPE_CHECKING:
    from PIL import Image as PILImage

    from lemonkit.client.audio_clips import AudioClip

__all__ = ["ChatAccumulator", "ChatResult", "ModelList", "RankedDocument", "Ranking"]


@dataclass
class ChatResult:
    """One answer of :func:`lemonkit.chat` (or :func:`lemonkit.complete`).

    Attributes:
        text: The answer (``str(result)`` too).
        reasoning: What a reasoning model thought before answering (``""`` when it did not).
        tool_calls: The tools the model called, OpenAI-shaped (``{"id", "type", "function": {"name",
            "arguments"}}``).
        usage: Token counts (``prompt_tokens``, ``completion_tokens``, ``total_tokens``).
        timings: The engine's figures (llama-server's ``timings``: ``predicted_per_second``, ...).
        finish_reason: ``"stop"``, ``"length"``, ``"tool_calls"``; ``None`` when interrupted.
        raw: The server's answer: the completion object, or the list of streamed chunks.
        provenance: Model, checkpoint, revision, file sha256, recipe options, sampling and seed, versions, wall time
            and the request itself (what :func:`lemonkit.replay` reruns).
    """

    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    finish_reason: str | None = None
    raw: Any = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        model = self.provenance.get("model")
        return f"ChatResult(text={text!r}, model={model!r}, finish_reason={self.finish_reason!r})"

    @property
    def media(self) -> list[Media]:
        """The images and sounds an omni collection embedded in :attr:`text`, in order."""
        return find_media(self.text)

    @property
    def images(self) -> list[PILImage.Image]:
        """The images of :attr:`media`, decoded."""
        from PIL import Image

        return [Image.open(io.BytesIO(m.data)) for m in self.media if m.kind == "image"]

    @property
    def audio(self) -> list[AudioClip]:
        """The sounds of :attr:`media`, decoded (each plays inline in a notebook).

        Raises:
            UndecodableAudio: No installed decoder reads one.
        """
        from lemonkit.client.audio_clips import AudioClip

        return [AudioClip.from_bytes(m.data) for m in self.media if m.kind == "audio"]

    def _repr_html_(self) -> str | None:
        """An answer with media shows its text, its images and players for its sounds; any other shows as text."""
        return media_html(self.text)

    @property
    def message(self) -> dict[str, Any]:
        """The answer as an assistant message, ready to append to a conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


class ChatAccumulator:
    """Folds a chat answer, whole or streamed, into a :class:`ChatResult`."""

    def __init__(self) -> None:
        self.result = ChatResult(raw=[])
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, chunk: dict[str, Any]) -> tuple[str, str]:
        """Take one streamed chunk; returns the ``(content, reasoning)`` it added."""
        self.result.raw.append(chunk)
        self._totals(chunk)
        content = reasoning = ""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content += delta.get("content") or choice.get("text") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                self._merge_call(call)
            self.result.finish_reason = choice.get("finish_reason") or self.result.finish_reason
        self._text.append(content)
        self._reasoning.append(reasoning)
        return content, reasoning

    def whole(self, body: dict[str, Any]) -> ChatResult:
        """The result of a non-streamed answer."""
        choice = (body.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        self.result = ChatResult(
            text=message.get("content") or choice.get("text") or "",
            reasoning=message.get("reasoning_content") or "",
            tool_calls=list(message.get("tool_calls") or []),
            finish_reason=choice.get("finish_reason"),
            raw=body,
        )
        self._totals(body)
        return self.result

    def finish(self) -> ChatResult:
        """The result of the chunks fed so far."""
        self.result.text = "".join(self._text)
        self.result.reasoning = "".join(self._reasoning)
        self.result.tool_calls = [self._calls[i] for i in sorted(self._calls)]
        return self.result

    def _totals(self, chunk: dict[str, Any]) -> None:
        self.result.usage = chunk.get("usage") or self.result.usage
        self.result.timings = chunk.get("timings") or self.result.timings

    def _merge_call(self, part: dict[str, Any]) -> None:
        call = self._calls.setdefault(
            part.get("index", len(self._calls)),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        call["id"] = part.get("id") or call["id"]
        function = part.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


@dataclass(frozen=True)
class RankedDocument:
    """One document of a :class:`Ranking`: its position in the input, its score, itself."""

    index: int
    score: float
    document: str


class Ranking(list[RankedDocument]):
    """Documents best first, with how they were scored.

    Attributes:
        model: The model that scored them.
        method: ``"rerank"`` (a reranking model's relevance scores) or ``"embedding-cosine"`` (cosine similarity of
            an embedding model's vectors, when no reranking model was named, loaded or downloaded).
    """

    def __init__(self, items: list[RankedDocument], *, model: str, method: str) -> None:
        super().__init__(sorted(items, key=lambda r: -r.score))
        self.model = model
        self.method = method


class ModelList(list[dict[str, Any]]):
    """Model records (``/v1/models`` entries); in a notebook it displays as the model browser.

    Args:
        records: The entries.
        client: The client they came from (the browser's).
    """

    def __init__(self, records: list[dict[str, Any]], *, client: Any = None) -> None:
        super().__init__(records)
        self._client = client

    def to_pandas(self) -> Any:
        """The records as a ``pandas.DataFrame``, one row per model, indexed by ``id``."""
        import pandas as pd

        return pd.DataFrame(list(self)).set_index("id") if self else pd.DataFrame()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        try:
            from lemonkit.widgets import ModelBrowser

            rendered: Any = ModelBrowser(client=self._client)._repr_mimebundle_(include=include, exclude=exclude)
        except ImportError:  # lemonkit.widgets or anywidget missing: a static table
            rendered = None
        bundle: dict[str, Any] | None = rendered[0] if isinstance(rendered, tuple) else rendered  # (data, metadata)
        return bundle or {"text/html": self._html(), "text/plain": repr(self)}

    def _html(self) -> str:
        columns = ("id", "recipe", "downloaded", "labels", "size")
        head = "".join(f"<th>{c}</th>" for c in columns)
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_cell(m.get(c)))}</td>" for c in columns) + "</tr>" for m in self
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return "" if value is None else str(value)

"""An omni answer in a notebook: :class:`lemonkit.ChatResult` shows the images and sounds embedded in its text
(what IPython's display machinery puts in the output's mimebundle), and decodes them for the user."""

from __future__ import annotations

import base64
import io

import numpy as np
from IPython.core.formatters import DisplayFormatter
from PIL import Image

from lemonkit.catalog.omni.media import audio_tag, image_markdown
from lemonkit.client.display import _without_media
from lemonkit.client.results import ChatResult
from lemonkit.formats import audio_codec as audio


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (12, 8), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def _mp3() -> bytes:
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000).astype(np.float32)
    return audio.encode(tone, 16000, "mp3")


PNG, MP3 = _png(), _mp3()
PNG64, MP364 = base64.b64encode(PNG).decode(), base64.b64encode(MP3).decode()
TEXT = f"Here is a red card.\n\n{image_markdown(PNG64)}\n\nAnd a beep: <b>{audio_tag(MP364)}"


def test_the_mimebundle_holds_the_image_and_the_audio() -> None:
    bundle, _ = DisplayFormatter().format(ChatResult(text=TEXT))
    page = bundle["text/html"]
    assert f'<img src="data:image/png;base64,{PNG64}"' in page
    assert f'<audio controls preload="auto" src="data:audio/mpeg;base64,{MP364}"></audio>' in page
    assert page.index("Here is a red card.") < page.index("<img") < page.index("And a beep") < page.index("<audio")
    assert "&lt;b&gt;" in page  # the answer's own text is escaped, not markup
    assert "text/plain" in bundle


def test_an_answer_without_media_stays_text() -> None:
    bundle, _ = DisplayFormatter().format(ChatResult(text="just words ![x](https://a.example/p.png)"))
    assert "text/html" not in bundle and "just words" in bundle["text/plain"]


def test_the_media_decode() -> None:
    result = ChatResult(text=TEXT)
    assert [m.kind for m in result.media] == ["image", "audio"] and result.media[0].data == PNG
    (image,) = result.images
    assert image.size == (12, 8) and image.convert("RGB").getpixel((3, 3)) == (200, 30, 30)
    (clip,) = result.audio
    assert abs(clip.duration - 1.0) < 0.1  # mp3 pads a frame or so at either end


def test_a_streaming_view_never_shows_base64() -> None:
    partial = TEXT[: TEXT.index("<audio>") + 200]  # the sound is still arriving
    shown = _without_media(partial)
    assert shown.endswith("[…]") and "[image]" in shown and "base64" not in shown

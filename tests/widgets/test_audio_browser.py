"""A real browser runs ``notebooks/audio.ipynb`` in JupyterLab (chromium, headless, offline, the bundled models)
and uses its two panels the way a person would: the speech panel speaks typed text into a playable audio element
with a download link; the transcription panel transcribes an uploaded WAV, lights the word under the player's
playhead as ``currentTime`` moves, and transcribes a real MediaRecorder capture of chromium's fake microphone, fed
an espeak-ng sentence (``--use-file-for-fake-audio-capture``).

Screenshots go to the test's tmp directory (printed; ``-rA`` shows them for a passing run).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.jupyter_lab import unavailable
from tests.support.speech import SENTENCES, normalised_words, speech_samples, speech_wav
from tests.widgets.test_browser import TIMEOUT, running

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None and not os.environ.get("CI"), reason=str(unavailable())),
]

AUDIO = Path(__file__).resolve().parents[2] / "notebooks" / "audio.ipynb"
UPLOADED = SENTENCES[1]  # "I would like to order a cup of coffee, please."
SPOKEN = SENTENCES[3]  # "Open the door and turn on the light." into the fake microphone
SILENCE = 0.6  # seconds of quiet before each loop of the fake microphone's sentence


def _env(tmp_path: Path) -> dict[str, str]:
    drop = ("LEMONKIT_URL", "LEMONKIT_TOKEN", "LEMONADE_API_KEY", "HF_HUB_OFFLINE")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("LEMONKIT_DEFAULT_")}
    return {**env, "HF_HUB_CACHE": str(tmp_path / "hf"), "LEMONADE_CACHE_DIR": str(tmp_path / "cache")}


def test_audio_notebook_panels_in_jupyterlab(tmp_path: Path) -> None:
    root = tmp_path / "lab"
    root.mkdir()
    uploaded = tmp_path / "coffee.wav"
    uploaded.write_bytes(speech_wav(UPLOADED, rate=22050))
    microphone = tmp_path / "microphone.wav"
    microphone.write_bytes(speech_wav(SPOKEN, rate=48000, silence=SILENCE))
    loop_ms = 1000 * (SILENCE + len(speech_samples(SPOKEN, 48000)) / 48000)
    flags = (
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={microphone}",
        "--autoplay-policy=no-user-gesture-required",
    )
    with running(root, _env(tmp_path), AUDIO, tmp_path / "screenshots", browser_args=flags) as (page, _, notebook):
        page.locator(".lk-transcription-panel").wait_for(timeout=3 * TIMEOUT)  # the last cell's output
        notebook.screenshot("audio-ran")
        check_cells(page)
        check_speech_panel(page)
        notebook.screenshot("speech-panel")
        check_upload_and_playhead(page, uploaded)
        page.locator(".lk-transcription-panel .lk-plot").scroll_into_view_if_needed()
        notebook.screenshot("transcribed-upload")
        check_recording(page, loop_ms)
        page.locator(".lk-transcription-panel .lk-plot").scroll_into_view_if_needed()
        notebook.screenshot("transcribed-recording")


def check_cells(page: Any) -> None:
    """Every cell ran: no traceback; the transcript's words, the timing plot and the SRT are there."""
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert errors.filter(has_text="Traceback").count() == 0
    assert page.locator(".jp-OutputArea-output .lk-transcript .lk-word").count() >= 10
    assert page.locator(".jp-OutputArea-output[data-mime-type='image/png'] img").count() >= 1
    assert page.locator(".jp-OutputArea-output", has_text="00:00:00,000 -->").count() == 1


def check_speech_panel(page: Any) -> None:
    """Typed text, a voice and a speed become a playable audio element and a download link."""
    panel = page.locator(".lk-speech-panel")
    voice = panel.get_by_label("Voice")
    page.wait_for_function(
        "() => document.querySelector('.lk-speech-panel [aria-label=Voice]')?.value", timeout=TIMEOUT
    )
    assert voice.locator("option").count() >= 1
    text = panel.get_by_label("Text to speak")
    assert text.input_value() == "Hello from lemonkit."
    text.fill("Thank you very much for your help.")
    panel.get_by_label("Speed").fill("1.2")
    panel.get_by_role("button", name="Speak the text").click()
    player = panel.locator('audio.lk-player[data-ready="true"]')
    player.wait_for(state="attached", timeout=TIMEOUT)
    duration = player.evaluate("a => a.duration")
    assert 1.0 < duration < 6.0, duration
    assert player.evaluate("a => a.play().then(() => !a.paused)")  # it plays
    link = panel.get_by_label("Download the speech as WAV")
    assert link.get_attribute("download") == "speech.wav" and link.get_attribute("href").startswith("blob:")
    assert link.evaluate("a => fetch(a.href).then(r => r.arrayBuffer()).then(b => b.byteLength)") > 10_000


def _words(panel: Any) -> list[str]:
    return normalised_words(" ".join(panel.locator(".lk-word").all_inner_texts()))


def check_upload_and_playhead(page: Any, uploaded: Path) -> None:
    """An uploaded file is transcribed with its timing plot; the highlighted word follows the playhead."""
    panel = page.locator(".lk-transcription-panel")
    assert panel.locator(".lk-plot").is_hidden() and panel.locator("audio.lk-player").is_hidden()  # nothing yet
    panel.get_by_label("Audio file to transcribe").set_input_files(str(uploaded))
    page.wait_for_selector('.lk-transcription-panel[data-busy="false"] .lk-word', timeout=TIMEOUT)
    assert _words(panel) == normalised_words(UPLOADED)
    assert "coffee.wav" not in panel.get_by_role("status").inner_text()  # done: the summary, not "Transcribing"
    plot = panel.get_by_alt_text("Word timing plot: each word's time over the waveform")
    page.wait_for_function(
        "() => document.querySelector('.lk-transcription-panel .lk-plot')?.naturalWidth > 0", timeout=TIMEOUT
    )
    assert plot.is_visible()
    assert not panel.locator(".lk-plot[hidden]").count()

    player = panel.locator("audio.lk-player")
    panel.locator('audio.lk-player[data-ready="true"]').wait_for(state="attached", timeout=TIMEOUT)
    spans = panel.locator(".lk-word")
    starts = [float(t.split(" to ")[0]) for t in spans.evaluate_all("s => s.map(w => w.title)")]
    for index in (len(starts) - 1, 2, 5):  # jump forward, back, forward
        player.evaluate("(a, t) => { a.currentTime = t; }", starts[index] + 0.01)
        page.wait_for_function(
            "i => document.querySelector('.lk-transcription-panel').dataset.currentWord === String(i)",
            arg=index,
            timeout=30_000,
        )
        current = panel.locator(".lk-word.lk-current")
        assert current.count() == 1 and current.get_attribute("data-index") == str(index)
        assert current.get_attribute("aria-current") == "true"


def check_recording(page: Any, loop_ms: float) -> None:
    """Recording from the (fake) microphone until a whole loop of its sentence is in, then stopping, transcribes
    what MediaRecorder captured."""
    panel = page.locator(".lk-transcription-panel")
    panel.get_by_role("button", name="Record from the microphone").click()
    page.wait_for_function(
        "ms => Number(document.querySelector('.lk-transcription-panel').dataset.recordedMs) >= ms",
        arg=2 * loop_ms + 500,  # two loops: one whole sentence, wherever the capture started
        timeout=TIMEOUT,
    )
    panel.get_by_role("button", name="Stop recording and transcribe").click()
    page.wait_for_function(  # busy goes true before the source changes, and false once the words are shown
        "() => { const p = document.querySelector('.lk-transcription-panel').dataset;"
        " return p.source === 'recording.webm' && p.busy === 'false' && p.recording === 'false'; }",
        timeout=TIMEOUT,
    )
    heard = _words(panel)
    assert {"open", "door", "turn", "light"} <= set(heard), heard
    player = panel.locator('audio.lk-player[data-ready="true"]')
    player.wait_for(state="attached", timeout=TIMEOUT)
    # the recording plays back as the kernel's WAV: a seekable player whose length is the recording's
    assert player.evaluate("a => a.duration") == pytest.approx(2 * loop_ms / 1000, abs=1.5)
    page.wait_for_function(  # the recording's own timing plot (the upload's was cleared when it started)
        "() => document.querySelector('.lk-transcription-panel .lk-plot')?.naturalWidth > 0", timeout=TIMEOUT
    )

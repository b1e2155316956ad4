"""Lemonade's ``Whisper-*`` names run on faster-whisper: pulling one fetches its whole CTranslate2 repo from the hub
(the local hub of ``tests/support/hub_server.py``, serving the bundled tiny.en files under
``Systran/faster-whisper-tiny``) and the model then transcribes, on both hosts."""

from __future__ import annotations

from pathlib import Path

import pytest

from lemonkit.catalog.registry import Registry
from tests.server.test_pull import Env, env, model, pull_standalone  # noqa: F401 - fixtures
from tests.support.speech import SENTENCES, normalised_words, speech_wav

REPO = "Systran/faster-whisper-tiny"
#: preprocessor_config.json as the Systran repos carry it (the bundled package leaves it out)
PREPROCESSOR = (
    b'{"chunk_length": 30, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80, '
    b'"hop_length": 160, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right", '
    b'"padding_value": 0.0, "processor_class": "WhisperProcessor", "return_attention_mask": false, '
    b'"sampling_rate": 16000}'
)


def ctranslate2_repo(tmp: Path) -> dict[str, bytes | Path]:
    bundled = Registry(tmp / "cache", hf_cache=tmp / "hf")
    model_dir = bundled.resolve(bundled.get("Whisper-Tiny-En-Bundled")).main
    files: dict[str, bytes | Path] = {p.name: p for p in model_dir.iterdir()}
    files.update({"preprocessor_config.json": PREPROCESSOR, "README.md": b"# faster-whisper tiny\n"})
    return files


@pytest.mark.slow
async def test_pull_a_ctranslate2_repo_then_transcribe(env: Env, tmp_path: Path) -> None:  # noqa: F811
    files = ctranslate2_repo(tmp_path)
    if env.hub._lookup(REPO) is None:
        env.hub.add_repo(REPO, files)
    async with env.client() as client:
        before = await model(client, "Whisper-Tiny")
        assert before["recipe"] == "faster-whisper" and before["checkpoint"] == REPO and before["supported"]
        response = await client.post("pull", json={"model_name": "Whisper-Tiny"})
        assert response.status_code == 200 and response.json()["status"] == "success", response.text
        assert (await model(client, "Whisper-Tiny"))["downloaded"] is True
        answer = await client.post(
            "audio/transcriptions",
            data={"model": "Whisper-Tiny"},
            files={"file": ("speech.wav", speech_wav(SENTENCES[4]))},
        )
    assert answer.status_code == 200, answer.text
    assert normalised_words(answer.json()["text"]) == normalised_words(SENTENCES[4])
    snapshots = list((env.storage(REPO) / "snapshots").iterdir())
    assert len(snapshots) == 1
    assert sorted(p.name for p in snapshots[0].iterdir()) == sorted(files)  # the whole repo, not one file

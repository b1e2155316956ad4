"""The notebooks in ``notebooks/`` executed headless with nbclient, every cell, on the bundled models, offline: the
hub is an unreachable loopback port and the caches are empty. ``quickstart.ipynb`` runs in a kernel started by a
Jupyter server with the extension and in a plain kernel (the embedded server); ``clients.ipynb`` in a Jupyter
server's kernel, finding that server's URL and token itself; ``audio.ipynb`` (speech, transcripts, their plot,
alignment, the audio panels) and ``images.ipynb`` (the bundled Real-ESRGAN's upscale as a grid, saved; generation
skipped with a note for want of an image model; the image panel) in a Jupyter server's kernel. A check cell
appended to each copy reports the kernel's state as JSON, so the tests assert on values, not only on the absence
of errors."""

from __future__ import annotations

import ast
import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest
from nbclient import NotebookClient

from lemonkit.catalog.config import (
    DEFAULT_CHAT_MODEL,
    DEFAULT_EMBEDDING_MODEL,
    DEFAULT_SPEECH_MODEL,
    DEFAULT_TRANSCRIPTION_MODEL,
    DEFAULT_UPSCALE_MODEL,
)
from tests.support.jupyter_process import JupyterServer, free_port
from tests.support.speech import word_errors

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
WIDGET = "application/vnd.jupyter.widget-view+json"

QUICKSTART_CHECK = """
import json
print(json.dumps({
    "kind": lemonkit.default_client().server.kind,
    "server": result.provenance["server"],
    "model": result.provenance["model"],
    "text": result.text,
    "replayed": replayed.matched,
    "turns": [m["role"] for m in resumed.messages],
    "element": element.model_dump(),
    "shape": list(vectors.shape),
    "ranked": [ranked.method, ranked.model, [r.index for r in ranked]],
    "map_errors": len(synonyms.errors),
    "map_outputs": [r.text for r in synonyms],
    "magic": _.provenance["request"]["messages"][-1]["content"],
}))
"""

CLIENTS_CHECK = """
import json
print(json.dumps({"url": lemonkit.openai_url(), "key": oai.api_key, "city": city.model_dump(), "pieces": len(pieces)}))
"""


AUDIO_CHECK = """
import json
print(json.dumps({
    "kind": lemonkit.default_client().server.kind,
    "sentence": sentence,
    "heard": transcript.text,
    "words": [[w.word, w.start, w.end] for w in transcript.words],
    "models": [speech.model, transcript.model],
    "duration": speech.duration,
    "aligned": [w.word for w in aligned.words],
    "rows": len(words),
}))
"""


IMAGES_CHECK = """
import json
print(json.dumps({
    "kind": lemonkit.default_client().server.kind,
    "sizes": [list(picture.size), list(big[0].size)],
    "model": big.provenance["model"],
    "route": big.provenance["route"],
    "saved": [str(p) for p in paths],
    "generator": generator,
    "spread": float(__import__("numpy").asarray(big[0], dtype="float32").std()),
}))
"""


def _offline_env(directory: Path) -> dict[str, str]:
    """Empty caches, no server to find but the one the test means, and a hub that cannot be reached."""
    drop = ("LEMONKIT_URL", "LEMONKIT_TOKEN", "LEMONADE_API_KEY", "HF_HUB_OFFLINE")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("LEMONKIT_DEFAULT_")}
    return {
        **env,
        "LEMONADE_CACHE_DIR": str(directory / "cache"),
        "HF_HUB_CACHE": str(directory / "hf"),
        "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # nothing listens there: a hub request fails
        "JUPYTER_RUNTIME_DIR": str(directory / "runtime"),
    }


def _with_check(name: str, check: str) -> Any:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    checked = copy.deepcopy(notebook)
    checked.cells.append(nbformat.v4.new_code_cell(check))
    return checked


def _outputs(notebook: Any, fragment: str) -> list[dict[str, Any]]:
    """The outputs of the one code cell whose source contains ``fragment``."""
    (cell,) = [c for c in notebook.cells if c.cell_type == "code" and fragment in c.source + "\n"]
    return list(cell.outputs)


def _printed(outputs: list[dict[str, Any]]) -> str:
    return "".join(o["text"] for o in outputs if o["output_type"] == "stream" and o["name"] == "stdout")


def _checked(notebook: Any) -> dict[str, Any]:
    return dict(json.loads(_printed(notebook.cells[-1].outputs)))


def _no_hub_downloads(directory: Path) -> None:
    hf = directory / "hf"
    assert not hf.exists() or not any(hf.glob("models--*")), sorted(hf.iterdir())


class ServerKernel:
    """A kernel started by ``server`` (as JupyterLab starts one), as nbclient's kernel manager: it has a kernel,
    so nbclient starts none of its own and only connects a client to this one."""

    has_kernel = True

    def __init__(self, server: JupyterServer) -> None:
        self.server = server
        self.headers = {"Authorization": f"token {server.token}"}
        self.id = httpx.post(server.base + "api/kernels", headers=self.headers, json={}, timeout=60).json()["id"]

    def client(self) -> Any:
        from jupyter_client.asynchronous import AsyncKernelClient

        class Client(AsyncKernelClient):  # type: ignore[misc]
            # No heartbeat: a client not made by a KernelManager takes a heartbeat missed in the kernel's first
            # second (a loaded machine starting it) for a dead kernel; the server says whether it lives.
            def start_channels(self, *args: Any, **kwargs: Any) -> None:
                super().start_channels(*args, **{**kwargs, "hb": False})

        client = Client(connection_file=str(self.server.runtime_dir / f"kernel-{self.id}.json"))
        client.load_connection_file()
        return client

    async def is_alive(self) -> bool:
        async with httpx.AsyncClient(headers=self.headers, timeout=60) as http:
            found = await http.get(f"{self.server.base}api/kernels/{self.id}")
        return found.status_code == 200 and found.json()["execution_state"] != "dead"

    async def shutdown_kernel(self, now: bool = False) -> None:
        async with httpx.AsyncClient(headers=self.headers, timeout=60) as http:
            await http.delete(f"{self.server.base}api/kernels/{self.id}")

    async def cleanup_resources(self) -> None:
        """The server cleans up the kernels it started."""

    def close(self) -> None:
        httpx.delete(f"{self.server.base}api/kernels/{self.id}", headers=self.headers, timeout=60)


@pytest.fixture(scope="module")
def offline_jupyter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[JupyterServer, Path]]:
    directory = tmp_path_factory.mktemp("notebooks-jupyter")
    server = JupyterServer(directory, env=_offline_env(directory))
    yield server, directory
    server.stop()


def _run_in(server: JupyterServer, notebook: Any) -> None:
    kernel = ServerKernel(server)
    client = NotebookClient(notebook, km=kernel, timeout=300)
    try:
        client.execute()
    finally:
        if client.kc is not None:
            client.kc.stop_channels()
        kernel.close()


def _assert_quickstart(notebook: Any, found: dict[str, Any]) -> None:
    (chat,) = _outputs(notebook, 'lemonkit.chat("Explain entropy')
    assert chat["output_type"] == "display_data"  # one display, updated as tokens came, Markdown once complete
    assert chat["data"]["text/markdown"] == found["text"] and len(found["text"].split()) >= 5
    assert found["model"] == DEFAULT_CHAT_MODEL and found["replayed"] is True
    assert _printed(_outputs(notebook, "lemonkit.replay(result)")) == "matched\n"
    assert found["turns"] == ["system", "user", "assistant", "user", "assistant"]
    assert 1 <= found["element"]["atomic_number"] <= 118 and len(found["element"]["symbol"]) <= 3
    assert found["shape"] == [4, 384] and _printed(_outputs(notebook, "lemonkit.embed(")).startswith("(4, 384)")
    method, model, order = found["ranked"]
    assert (method, model) == ("embedding-cosine", DEFAULT_EMBEDDING_MODEL)  # no reranker: the embeddings' cosine
    assert sorted(order) == [0, 1, 2, 3] and order[0] == 2  # the document about disorder answers the question best
    assert found["map_errors"] == 0 and all(found["map_outputs"])
    (models,) = [o for o in _outputs(notebook, "lemonkit.models()\n") if o["output_type"] == "execute_result"]
    assert WIDGET in models["data"]  # the model browser
    assert found["magic"].startswith("What is a Markov chain?")


def test_quickstart_in_a_jupyter_kernel(offline_jupyter: tuple[JupyterServer, Path]) -> None:
    server, directory = offline_jupyter
    notebook = _with_check("quickstart.ipynb", QUICKSTART_CHECK)
    _run_in(server, notebook)
    found = _checked(notebook)
    assert found["kind"] == "jupyter" and found["server"] == server.base + "lemonkit/api/v1"
    _assert_quickstart(notebook, found)
    status = _printed(_outputs(notebook, "%lemonkit status"))
    assert status.startswith("lemonkit ") and status.splitlines()[0].endswith("(jupyter)")
    _no_hub_downloads(directory)


def test_quickstart_with_the_embedded_server(tmp_path: Path) -> None:
    notebook = _with_check("quickstart.ipynb", QUICKSTART_CHECK)
    env = _offline_env(tmp_path)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}})
    client.execute(env=env)
    found = _checked(notebook)
    assert found["kind"] == "embedded" and found["server"].startswith("http://127.0.0.1:")
    _assert_quickstart(notebook, found)
    _no_hub_downloads(tmp_path)


def test_clients_in_a_jupyter_kernel(offline_jupyter: tuple[JupyterServer, Path]) -> None:
    server, directory = offline_jupyter
    notebook = _with_check("clients.ipynb", CLIENTS_CHECK)
    _run_in(server, notebook)
    found = _checked(notebook)
    # the notebook found the Jupyter server's endpoint and token by itself
    assert found["url"] == server.base + "lemonkit/api/v1" and found["key"] == server.token
    printed = _printed(_outputs(notebook, "print(lemonkit.openai_url())"))
    assert printed.splitlines() == [found["url"], DEFAULT_CHAT_MODEL]
    (listed,) = [o for o in _outputs(notebook, "oai.models.list()") if o["output_type"] == "execute_result"]
    assert DEFAULT_CHAT_MODEL in listed["data"]["text/plain"]
    streamed = _printed(_outputs(notebook, "stream=True"))
    assert int(streamed.rsplit("[", 1)[1].split()[0]) > 1  # the SDK's stream came in several chunks
    assert found["pieces"] > 1 and found["city"]["name"] and found["city"]["country"]
    (embedded,) = [o for o in _outputs(notebook, "embeddings.create(") if o["output_type"] == "execute_result"]
    assert embedded["data"]["text/plain"] == "(2, 384)"
    _no_hub_downloads(directory)


def _words(text: str) -> list[str]:
    return "".join(c.lower() if c.isalnum() else " " for c in text).split()


def test_audio_in_a_jupyter_kernel(offline_jupyter: tuple[JupyterServer, Path]) -> None:
    server, directory = offline_jupyter
    notebook = _with_check("audio.ipynb", AUDIO_CHECK)
    _run_in(server, notebook)
    found = _checked(notebook)
    assert found["kind"] == "jupyter" and found["models"] == [DEFAULT_SPEECH_MODEL, DEFAULT_TRANSCRIPTION_MODEL]
    # what speak() said, transcribe() heard; Piper samples noise as it speaks, so Whisper tiny may mishear a word
    assert word_errors(found["sentence"], found["heard"]) <= 1, found["heard"]
    assert _words(" ".join(found["aligned"])) == _words(found["sentence"])
    starts = [start for _, start, _ in found["words"]]
    assert starts == sorted(starts) and all(0 <= s <= e <= found["duration"] + 0.05 for _, s, e in found["words"])
    assert found["rows"] == len(found["words"])
    (played,) = _outputs(notebook, "speech = lemonkit.speak(sentence)")
    assert "<audio" in played["data"]["text/html"]  # plays inline
    (shown,) = _outputs(notebook, "transcript = lemonkit.transcribe(speech)")
    assert shown["data"]["text/html"].count('class="lk-word"') == len(found["words"])
    (plot,) = _outputs(notebook, "transcript.plot()\n")
    assert plot["data"]["image/png"]  # the word-timing figure, once
    srt = _printed(_outputs(notebook, "transcript.to_srt()"))
    assert srt.startswith("1\n00:00:0") and " --> " in srt
    slow = ast.literal_eval(_outputs(notebook, "sample_rate=44100")[-1]["data"]["text/plain"])
    assert word_errors("Open the door and turn on the light.", slow) <= 1, slow
    saved = ast.literal_eval(_outputs(notebook, "speech.save(")[-1]["data"]["text/plain"])
    assert word_errors(found["sentence"], saved) <= 1, saved
    # a spoken question answered with speech that plays inline
    (answered,) = [
        o for o in _outputs(notebook, "reply = lemonkit.voice_chat(") if o["output_type"] == "execute_result"
    ]
    assert "<audio" in answered["data"]["text/html"] and "Heard:" in answered["data"]["text/html"]
    transcript_and_reply = _printed(_outputs(notebook, "print(reply.transcript)")).splitlines()
    assert word_errors("What is the capital of France?", transcript_and_reply[0]) <= 1 and transcript_and_reply[1]
    for fragment in ("lemonkit.SpeechPanel(", "lemonkit.TranscriptionPanel()"):
        (panel,) = [o for o in _outputs(notebook, fragment) if o["output_type"] == "execute_result"]
        assert WIDGET in panel["data"]
    _no_hub_downloads(directory)


def test_images_in_a_jupyter_kernel(offline_jupyter: tuple[JupyterServer, Path]) -> None:
    from PIL import Image

    server, directory = offline_jupyter
    notebook = _with_check("images.ipynb", IMAGES_CHECK)
    _run_in(server, notebook)
    found = _checked(notebook)
    assert found["kind"] == "jupyter" and found["generator"] is None  # empty caches: no image model to draw with
    assert found["sizes"] == [[96, 64], [384, 256]]  # Real-ESRGAN x4plus, bundled: 4x, offline
    assert found["model"] == DEFAULT_UPSCALE_MODEL and found["route"] == "images/upscale"
    assert found["spread"] > 20  # the picture, not a blank
    (grid,) = _outputs(notebook, "big = lemonkit.upscale(picture)")
    assert grid["data"]["text/html"].count('class="lk-image"') == 1
    assert grid["data"]["text/plain"].startswith("Images(1: 384x256")
    (saved,) = found["saved"]
    with Image.open(saved) as png:
        assert png.size == (384, 256) and json.loads(png.text["lemonkit"])["model"] == DEFAULT_UPSCALE_MODEL
    note = _printed(_outputs(notebook, "generator = image_models[0]"))
    assert note.startswith("No image generation model is downloaded") and 'lemonkit.pull("SD-Turbo")' in note
    for fragment in ("images = lemonkit.generate_image(", "source = images[0]"):
        assert _outputs(notebook, fragment) == []  # skipped, silently: the note said so
    (panel,) = [o for o in _outputs(notebook, "lemonkit.ImagePanel(") if o["output_type"] == "execute_result"]
    assert WIDGET in panel["data"]
    _no_hub_downloads(directory)

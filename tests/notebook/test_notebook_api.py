"""The Python API where users run it: a real kernel inside a Jupyter server with the extension (display messages,
interrupts, magics, the OpenAI URL), and a plain process with the embedded server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.jupyter_process import JupyterServer
from tests.support.tiny_models import EMBED, TINY, TINY_B

pytestmark = pytest.mark.slow

DEFAULTS = {"LEMONKIT_DEFAULT_CHAT_MODEL": TINY, "LEMONKIT_DEFAULT_EMBEDDING_MODEL": EMBED}


def _clean_env(runtime: Path) -> dict[str, str]:
    """No server to find but the one the test means: no URL, no key, a runtime directory of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("LEMONKIT_URL", "LEMONKIT_TOKEN", "LEMONADE_API_KEY")}
    return {**env, **DEFAULTS, "JUPYTER_RUNTIME_DIR": str(runtime)}


class Kernel:
    """A kernel the Jupyter server started, driven over its ZMQ channels; ``run`` returns every iopub message."""

    def __init__(self, server: JupyterServer) -> None:
        from jupyter_client.blocking import BlockingKernelClient

        self.server = server
        self.headers = {"Authorization": f"token {server.token}"}
        self.id = httpx.post(server.base + "api/kernels", headers=self.headers, json={}, timeout=60).json()["id"]
        self.client = BlockingKernelClient(connection_file=str(server.runtime_dir / f"kernel-{self.id}.json"))
        self.client.load_connection_file()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def run(self, code: str, *, timeout: float = 120) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        messages: list[dict[str, Any]] = []
        reply = self.client.execute_interactive(code, output_hook=messages.append, timeout=timeout)
        return reply["content"], messages

    def ok(self, code: str) -> list[dict[str, Any]]:
        reply, messages = self.run(code)
        assert reply["status"] == "ok", _text(messages) + "\n".join(reply.get("traceback", []))
        return messages

    def interrupt(self) -> None:
        url = f"{self.server.base}api/kernels/{self.id}/interrupt"
        httpx.post(url, headers=self.headers, timeout=30).raise_for_status()

    def close(self) -> None:
        self.client.stop_channels()


def _text(messages: list[dict[str, Any]]) -> str:
    """What the cell printed (and any traceback)."""
    parts = []
    for msg in messages:
        if msg["msg_type"] == "stream":
            parts.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            parts.append("\n".join(msg["content"]["traceback"]))
    return "".join(parts)


@pytest.fixture(scope="module")
def jupyter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterServer]:
    directory = tmp_path_factory.mktemp("jupyter")
    server = JupyterServer(directory, env=_clean_env(directory / "runtime"))
    yield server
    server.stop()


@pytest.fixture
def kernel(jupyter: JupyterServer) -> Iterator[Kernel]:
    kernel = Kernel(jupyter)
    yield kernel
    kernel.close()
    httpx.delete(f"{jupyter.base}api/kernels/{kernel.id}", headers=kernel.headers, timeout=60)
    httpx.post(jupyter.base + "lemonkit/api/v1/unload", headers=kernel.headers, json={}, timeout=60)


def test_chat_in_a_kernel_updates_one_display(kernel: Kernel, jupyter: JupyterServer) -> None:
    messages = kernel.ok("import lemonkit\nresult = lemonkit.chat('Say hello.', max_tokens=40)")
    displays = [m for m in messages if m["msg_type"] in ("display_data", "update_display_data")]
    assert _text(messages) == ""  # nothing printed: the answer is in the display
    first, *updates = displays
    assert first["msg_type"] == "display_data" and updates
    display_id = first["content"]["transient"]["display_id"]
    assert all(m["msg_type"] == "update_display_data" for m in updates)
    assert {m["content"]["transient"]["display_id"] for m in updates} == {display_id}  # one output, redrawn
    final = updates[-1]["content"]["data"]
    streaming = [m["content"]["data"]["text/plain"] for m in updates[:-1]]
    code = "import json\nprint(json.dumps([result.text, result.provenance['server'], lemonkit.openai_url()]))"
    reply = kernel.ok(code)
    text, server, url = json.loads(_text(reply))
    assert final["text/markdown"] == final["text/plain"] == text  # Markdown once complete
    assert all(text.startswith(part) for part in streaming)  # the answer grew in place
    assert server == url == jupyter.base + "lemonkit/api/v1"
    # the openai SDK from the same kernel, with the Jupyter token
    listed = kernel.ok("print([m.id for m in lemonkit.openai_client().models.list()])")
    assert TINY in _text(listed)
    # a reasoning model's thoughts: collapsed while streaming and once complete
    code = "from lemonkit.client.display import NotebookView\nv = NotebookView()\nv.add('', 'a <thought>')\n"
    code += "v.add('42', '')\nv.close()"
    shown = [m["content"]["data"] for m in kernel.ok(code) if m["msg_type"] == "update_display_data"]
    assert shown[0]["text/html"].startswith("<details><summary>Reasoning</summary>")
    assert "a &lt;thought&gt;" in shown[0]["text/html"]  # escaped while it streams as HTML
    assert shown[-1]["text/markdown"] == "<details><summary>Reasoning</summary>\n\na <thought>\n\n</details>\n\n42"


def test_interrupting_the_kernel_stops_the_generation(kernel: Kernel, jupyter: JupyterServer) -> None:
    kernel.ok(f"import lemonkit\nlemonkit.load({TINY!r}, ctx_size=8192)\nlemonkit.chat('hi', max_tokens=2)")
    kernel.client.execute("lemonkit.chat('Count to a million. ' * 30, max_tokens=8000)")
    while True:  # the answer is streaming once its display is redrawn
        msg = kernel.client.get_iopub_msg(timeout=60)
        if msg["msg_type"] == "update_display_data":
            break
    kernel.interrupt()
    reply = kernel.client.get_shell_msg(timeout=60)["content"]
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    headers = {"Authorization": f"token {jupyter.token}"}
    api = jupyter.base + "lemonkit/api/v1/"
    # the engine records a generation's figures when it ends (cancelled or not): wait for the long prompt's
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = httpx.get(api + "stats", headers=headers, timeout=60).json()
        if (stats["prompt_tokens"] or 0) > 100:
            break
        time.sleep(0.05)
    assert stats["prompt_tokens"] > 100, stats
    assert 0 < stats["output_tokens"] < 4000  # it stopped long before its 8000 tokens
    follow = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    answer = httpx.post(api + "chat/completions", json=follow, headers=headers, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5  # the engine is free


def test_a_map_interrupted_and_run_again_after_a_kernel_restart_follows_its_batch(
    kernel: Kernel, jupyter: JupyterServer
) -> None:
    """Interrupting leaves the server's batch running; the same cell after a restart picks that batch up."""
    headers = {"Authorization": f"token {jupyter.token}"}
    api = jupyter.base + "lemonkit/api/v1/"
    httpx.delete(api + "cache", headers=headers, timeout=60).raise_for_status()
    cell = textwrap.dedent(
        """
        import json, lemonkit
        out = lemonkit.map("Write about topic {}.", list(range(120)), max_tokens=128, progress=False)
        print(json.dumps({"interrupted": out.interrupted, "batch": out.batch_id, "stats": out.stats,
                          "done": len(out) - len(out.pending), "errors": len(out.errors)}))
        """
    )
    kernel.client.execute(cell)

    def running() -> dict[str, Any] | None:
        for batch in httpx.get(api + "batches", headers=headers, timeout=60).json()["data"]:
            if batch["status"] == "in_progress" and batch["request_counts"]["completed"] >= 2:
                return dict(batch)
        return None

    deadline = time.monotonic() + 120
    while (batch := running()) is None:
        assert time.monotonic() < deadline, "the map's batch did not start"
        time.sleep(0.05)
    kernel.interrupt()
    reply = kernel.client.get_shell_msg(timeout=60)["content"]
    assert reply["status"] == "ok", reply  # interrupting returns what is done, and says where the rest goes
    assert httpx.get(api + f"batches/{batch['id']}", headers=headers, timeout=60).json()["status"] in (
        "in_progress",
        "finalizing",
        "completed",
    )

    restart = httpx.post(f"{jupyter.base}api/kernels/{kernel.id}/restart", headers=headers, timeout=60)
    assert restart.status_code == 200, restart.text
    kernel.client.wait_for_ready(timeout=60)
    summary = json.loads(_text(kernel.ok(cell)).strip().splitlines()[-1])
    assert summary["interrupted"] is False and summary["done"] == 120 and summary["errors"] == 0
    if summary["batch"] is None:  # the batch ended before the cell ran again: every row came from the cache
        assert summary["stats"]["cache_hits"] == 120 and summary["stats"]["computed"] == 0, summary
    else:  # followed, not submitted again; what it finished before the restart came from the cache
        assert summary["batch"] == batch["id"] and summary["stats"]["cache_hits"] >= 2, summary
    fingerprint = batch["metadata"]["lemonkit_map"]
    every = httpx.get(api + "batches", headers=headers, params={"limit": 100}, timeout=60).json()["data"]
    assert [b["id"] for b in every if (b.get("metadata") or {}).get("lemonkit_map") == fingerprint] == [batch["id"]]


def test_magics(kernel: Kernel, jupyter: JupyterServer) -> None:
    kernel.ok("%load_ext lemonkit")
    messages = kernel.ok(f"%%chat --model {TINY} --system 'Be brief.' --max-tokens 5\nSay hi")
    (result,) = [m for m in messages if m["msg_type"] == "execute_result"]
    assert result["content"]["data"]["text/plain"].startswith("ChatResult(")  # the cell's value
    held = _text(kernel.ok("print(type(_).__name__, _.provenance['model'], _.provenance['request']['messages'])"))
    assert held.startswith(f"ChatResult {TINY} [{{'role': 'system', 'content': 'Be brief.'}}, ")
    assert "'content': 'Say hi'" in held
    loaded = _text(kernel.ok(f"%lemonkit load {TINY_B}"))
    assert TINY_B in loaded
    status = _text(kernel.ok("%lemonkit status"))
    assert status.splitlines()[0].endswith(f"at {jupyter.base}lemonkit/api/v1 (jupyter)")
    loaded_line = status.splitlines()[1]  # memory decides: the other model may still be loaded beside it
    assert loaded_line.startswith("loaded: ") and f"{TINY_B} (llm, pid " in loaded_line
    (models,) = [m for m in kernel.ok("%lemonkit models") if m["msg_type"] == "execute_result"]
    bundle = models["content"]["data"]
    assert TINY in json.dumps(bundle)
    kernel.ok("%lemonkit unload")
    assert _text(kernel.ok("%lemonkit status")).splitlines()[1] == "loaded: nothing"
    assert _text(kernel.ok("%lemonkit bogus")).startswith("usage: %lemonkit")


def test_the_embedded_server_serves_the_api(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import json, lemonkit
        result = lemonkit.chat("Say hello.", max_tokens=6)
        vectors = lemonkit.embed(["a", "b", "c"])
        oai = lemonkit.openai_client(max_retries=0)
        print(json.dumps({
            "kind": lemonkit.default_client().server.kind,
            "url": lemonkit.openai_url(),
            "text": result.text,
            "provenance": result.provenance,
            "shape": list(vectors.shape),
            "models": [m.id for m in oai.models.list()],
            "replayed": lemonkit.replay(result).matched,
        }))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], env=_clean_env(tmp_path), capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr
    printed, summary = run.stdout.rsplit("\n", 2)[:2]
    found = json.loads(summary)
    assert printed == found["text"]  # the answer was printed as it streamed
    assert found["kind"] == "embedded" and found["url"].startswith("http://127.0.0.1:")
    assert found["provenance"]["server"] == found["url"] and found["provenance"]["model"] == TINY
    assert found["shape"][0] == 3 and TINY in found["models"] and found["replayed"] is True


def test_the_openai_url_under_a_jupyterhub_user_prefix(tmp_path: Path) -> None:
    server = JupyterServer(tmp_path, env=_clean_env(tmp_path / "runtime"), base_url="/user/alice/")
    kernel = Kernel(server)
    try:
        code = "import lemonkit\nprint(lemonkit.openai_url())\nprint(len(lemonkit.openai_client().models.list().data))"
        url, count = _text(kernel.ok(code)).split()
        assert url == f"http://127.0.0.1:{server.port}/user/alice/lemonkit/api/v1" and int(count) > 0
    finally:
        kernel.close()
        server.stop()

"""The ``lemonkit`` command as a person meets it: ``lemonkit run`` (the README's first command) answers once and
keeps serving, logs stay out of the answer, and every failure is one line and exit status 2, never a traceback."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from lemonkit.catalog.config import DEFAULT_CHAT_MODEL
from lemonkit.cli import DEMO_QUESTION, chat_demo_body, demo_body
from tests.support.hosts import API_KEY, Standalone
from tests.support.session import CACHE_DIR
from tests.support.tiny_models import GEMMA, TINY


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lemonkit.cli", *args],
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line_error(done: subprocess.CompletedProcess[str], command: str) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) >= 1 and lines[-1].startswith(f"lemonkit {command}: "), done.stderr
    return lines[-1]


class _Run:
    """``lemonkit run [args]`` with ``LEMONADE_API_KEY`` set, read up to its "Serving" line."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        env = {**os.environ, "LEMONADE_API_KEY": API_KEY, "JUPYTER_RUNTIME_DIR": str(tmp_path)}
        env.pop("LEMONKIT_DEFAULT_CHAT_MODEL", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lemonkit.cli", "run", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert self.process.stdout is not None
        self.lines: list[str] = []
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("Serving "):
                break

    def answer(self, max_tokens: int) -> tuple[str, str]:
        """The streamed answer and the API root; checks that nothing but the question, the answer, the stats and
        where it serves was printed (no log line in the answer) and that the answer ended before ``max_tokens``."""
        lines = self.lines
        assert [line.strip() for line in lines[:2]] == ["", DEMO_QUESTION], lines
        assert lines[-1].startswith("Serving ") and lines[-3] == "\n", lines
        stats = re.fullmatch(r"\[(\d+) tokens at [\d.]+ tok/s\]\n", lines[-2])
        assert stats and 0 < int(stats.group(1)) < max_tokens, lines  # not cut
        return "".join(lines[2:-3]).strip(), lines[-1].split(" at ")[1].split(" ")[0]

    def stop(self) -> None:
        self.process.terminate()
        _, stderr = self.process.communicate(timeout=30)
        assert self.process.returncode == 0
        # the server's log went to a file, named in one line on stderr
        log = CACHE_DIR / "logs" / "lemonkit-run.log"
        assert stderr.splitlines() == [f"lemonkit run: the server's log is in {log}"], stderr
        assert "lemonkit serving on" in log.read_text()


def test_lemonkit_run_chats_with_the_bundled_default_and_keeps_serving(tmp_path: Path) -> None:
    run = _Run(tmp_path)
    try:
        assert run.lines[-1].startswith(f"Serving {DEFAULT_CHAT_MODEL} at "), run.lines
        body = chat_demo_body(DEFAULT_CHAT_MODEL, DEMO_QUESTION)
        answer, api = run.answer(body["max_tokens"])
        assert len(answer.split()) >= 5 and "blue" in answer.lower(), answer

        # the run used LEMONADE_API_KEY; it chatted: the same chat, unstreamed, gives the same text and ends on its own
        assert httpx.get(f"{api}/models", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=api, api_key=API_KEY)
        done = client.chat.completions.create(**{**body, "stream": False})
        assert done.choices[0].finish_reason == "stop"
        assert done.choices[0].message.content is not None and done.choices[0].message.content.strip() == answer
    finally:
        run.stop()


@pytest.mark.gemma
def test_lemonkit_run_of_a_base_model_completes(tmp_path: Path) -> None:
    run = _Run(tmp_path, GEMMA)
    try:
        body = {**demo_body(GEMMA, DEMO_QUESTION), "stream": False}
        answer, api = run.answer(body["max_tokens"])
        assert len(answer.split()) >= 2 and "\n" not in answer, run.lines  # the Q/A prompt stops at the line's end

        # a base model has no chat template: the run asked through /completions, which ends on its own too
        headers = {"Authorization": f"Bearer {API_KEY}"}
        done = httpx.post(f"{api}/completions", json=body, headers=headers, timeout=120).json()
        assert done["choices"][0]["finish_reason"] == "stop" and done["choices"][0]["text"].strip() == answer
        assert done["usage"]["completion_tokens"] < body["max_tokens"]
    finally:
        run.stop()


def test_run_of_an_unknown_model_is_one_line(tmp_path: Path) -> None:
    done = _cli("run", "user.no-such-model", "--port", "0", env={"JUPYTER_RUNTIME_DIR": str(tmp_path)})
    assert "404" in _one_line_error(done, "run") and "user.no-such-model" in done.stderr


def test_serve_of_a_broken_model_is_one_line(tmp_path: Path) -> None:
    done = _cli("serve", "--port", "0", "--load", "user.broken-gguf", env={"JUPYTER_RUNTIME_DIR": str(tmp_path)})
    assert "user.broken-gguf" in _one_line_error(done, "serve")


def test_serve_on_a_taken_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _cli("serve", "--port", str(taken.getsockname()[1]), env={"JUPYTER_RUNTIME_DIR": str(tmp_path)})
    assert "already in use" in _one_line_error(done, "serve")


def test_serve_refuses_bad_server_wide_llamacpp_args() -> None:
    done = _cli("serve", "--port", "0", env={"LEMONADE_LLAMACPP_ARGS": "-t 2 --no-such-flag"})
    line = _one_line_error(done, "serve")
    assert "LEMONADE_LLAMACPP_ARGS" in line and "--no-such-flag" in line


def test_commands_report_server_errors_in_one_line(standalone: Standalone) -> None:
    env = {"LEMONKIT_URL": standalone.root, "LEMONKIT_TOKEN": API_KEY}
    missing = _cli("load", "user.no-such-model", env=env)
    assert "404" in _one_line_error(missing, "load") and "user.no-such-model" in missing.stderr
    refused = _cli("list", env={**env, "LEMONKIT_TOKEN": "wrong"})
    assert "401" in _one_line_error(refused, "list")
    listed = _cli("list", env=env)
    assert listed.returncode == 0 and TINY in listed.stdout


def test_library_loggers_stay_at_warning_unless_asked() -> None:
    def requests(server: Standalone) -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"model": TINY, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(server.root + "api/v1/completions", json=body, headers=headers, timeout=120).is_success
        assert httpx.post(server.root + "api/v1/unload", json={}, headers=headers, timeout=60).is_success

    quiet = Standalone({"LEMONADE_API_KEY": API_KEY})
    try:
        requests(quiet)
    finally:
        quiet.stop()
    names = {m.group(1) for m in re.finditer(r" (?:DEBUG|INFO) ([\w.]+): ", "".join(quiet.log))}
    assert names and all(name.startswith("lemonkit") for name in names), names  # no httpx, tornado.access, ...

    verbose = Standalone({"LEMONADE_API_KEY": API_KEY}, args=("--log-level", "info"))
    try:
        requests(verbose)
    finally:
        verbose.stop()
    text = "".join(verbose.log)
    assert "INFO tornado.access: 200 POST /api/v1/completions" in text and "INFO httpx: HTTP Request" in text

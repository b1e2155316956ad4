"""The README's first command: ``lemonkit run`` serves the bundled model offline and answers once."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx


def test_lemonkit_run_serves_the_bundled_model() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "lemonkit.cli", "run", "--port", "0", "--prompt", "Monday, Tuesday, Wednesday,"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
        env=os.environ,
    )
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("Serving "):
                break
        output = "".join(lines)
        assert "Monday, Tuesday, Wednesday, Thursday, Friday" in output
        api = line.split(" at ")[1].split(" ")[0]
        # and it keeps serving the OpenAI API
        response = httpx.post(
            f"{api}/completions",
            json={"model": "Gemma-3-270m-GGUF", "prompt": "One, two, three,", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert response.json()["choices"][0]["text"].startswith(" four, five")
    finally:
        process.terminate()
        assert process.wait(30) == 0


def test_serve_refuses_bad_server_wide_llamacpp_args() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lemonkit.cli", "serve", "--port", "0"],
        env={**os.environ, "LEMONADE_LLAMACPP_ARGS": "-t 2 --no-such-flag"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "LEMONADE_LLAMACPP_ARGS" in done.stderr and "--no-such-flag" in done.stderr

"""The programs some tests run besides Python, which ``scripts/test`` installs: a test that needs one that is missing
skips with one line naming the command that installs it (in CI, where the script has run, it fails instead)."""

from __future__ import annotations

import os
import shutil

import pytest

__all__ = ["INSTALL", "missing", "tool"]

#: program -> the command that installs it (as root, or with sudo)
INSTALL = {
    "espeak-ng": "apt-get install espeak-ng",
    "ffmpeg": "apt-get install ffmpeg",
    "chromium": "apt-get install chromium",
    "configurable-http-proxy": "npm install -g configurable-http-proxy",
}


def missing(name: str) -> str | None:
    """Why ``name`` cannot run here (one line), or ``None`` when it is on ``PATH``."""
    if shutil.which(name) is not None:
        return None
    return f"{name} is not installed: run `{INSTALL[name]}` (scripts/test does, as root or with sudo)"


def tool(name: str) -> str:
    """The path of program ``name``; skips the calling test (fails it in CI) when it is not installed."""
    reason = missing(name)
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return str(shutil.which(name))

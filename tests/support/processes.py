"""Stopping the server processes the tests start."""

from __future__ import annotations

import subprocess

__all__ = ["stop_process"]


def stop_process(process: subprocess.Popen[bytes] | subprocess.Popen[str], *, grace: float = 20) -> None:
    """Terminate ``process`` and wait for it; kill it when it outlives ``grace`` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

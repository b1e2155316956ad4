"""Run a benchmark's in-process engine under the memory settings of lemonkit's llama.cpp sidecars.

A sidecar's glibc backs its large allocations with transparent huge pages (:func:`lemonkit.backends.sidecar_env`),
and the engine reads the weights into them. glibc reads that setting when a process starts, so a benchmark that
builds the engine in its own process, "as the sidecar builds it", re-runs itself with it first
(:func:`run_as_sidecar`); the servers it starts get the environment it was started with (:func:`server_env`), as a
user's would.
"""

from __future__ import annotations

import json
import os
import sys

from lemonkit.backends import sidecar_env

__all__ = ["run_as_sidecar", "server_env"]

_STARTED_WITH = "LEMONKIT_BENCH_GLIBC_TUNABLES"  # the caller's GLIBC_TUNABLES (JSON: null when unset)


def run_as_sidecar() -> None:
    """Re-execute this process with a llama.cpp sidecar's environment, unless it has it already."""
    env = sidecar_env("llamacpp")
    if _STARTED_WITH in os.environ or env == dict(os.environ):
        return
    env[_STARTED_WITH] = json.dumps(os.environ.get("GLIBC_TUNABLES"))
    sys.stdout.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def server_env() -> dict[str, str]:
    """This process's environment as it was before :func:`run_as_sidecar`."""
    env = dict(os.environ)
    if _STARTED_WITH in env:
        started_with = json.loads(env.pop(_STARTED_WITH))
        if started_with is None:
            env.pop("GLIBC_TUNABLES", None)
        else:
            env["GLIBC_TUNABLES"] = started_with
    return env

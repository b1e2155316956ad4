"""Run a benchmark's in-process engine under the settings of lemonkit's llama.cpp sidecars.

A sidecar's glibc backs its large allocations with transparent huge pages, and the engine reads the weights into
them; its OpenMP workers spin briefly (:func:`lemonkit.backends.sidecar_env`). glibc and libgomp read those settings
when a process starts, so a benchmark that builds the engine in its own process, "as the sidecar builds it", re-runs
itself with them first (:func:`run_as_sidecar`); the servers it starts get the environment it was started with
(:func:`server_env`), as a user's would.
"""

from __future__ import annotations

import json
import os
import sys

from lemonkit.backends import sidecar_env

__all__ = ["run_as_sidecar", "server_env"]

_STARTED_WITH = "LEMONKIT_BENCH_STARTED_WITH"  # what run_as_sidecar changed, as it was (JSON; null: unset)


def run_as_sidecar() -> None:
    """Re-execute this process with a llama.cpp sidecar's environment, unless it has it already."""
    env = sidecar_env("llamacpp")
    if _STARTED_WITH in os.environ or env == dict(os.environ):
        return
    env[_STARTED_WITH] = json.dumps({key: os.environ.get(key) for key in env if env[key] != os.environ.get(key)})
    sys.stdout.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def server_env() -> dict[str, str]:
    """This process's environment as it was before :func:`run_as_sidecar`."""
    env = dict(os.environ)
    for key, value in json.loads(env.pop(_STARTED_WITH, "{}")).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env

"""The ``lemonkit`` command.

- ``lemonkit serve [--host H] [--port P] [--load MODEL]``: the standalone server.
- ``lemonkit serve --jupyterhub-service``: the same API as a JupyterHub managed service, shared by the hub's users
  (see :mod:`lemonkit.server.jupyterhub`).
- ``lemonkit run [MODEL]``: serve, load the model (the bundled chat default, offline), answer one question, keep
  serving. A model with a chat template answers through ``/v1/chat/completions``; a base model (no template, like
  the bundled Gemma 270M) through a Q/A ``/v1/completions`` prompt.
- ``lemonkit pull|list|delete|load|unload|variants``: manage models on a running server (``LEMONKIT_URL``);
  see :mod:`lemonkit.commands`.

Errors reach a person as one line on stderr and exit status 2, never as a traceback (``--log-level debug`` logs
the traceback of an unexpected one).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote

from lemonkit import commands
from lemonkit.catalog.config import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_PORT,
    LiveLimits,
    RemoteSettings,
    Settings,
    UserLimits,
    default_chat_model,
)
from lemonkit.catalog.placement import parse_size

__all__ = ["DEMO_QUESTION", "chat_demo_body", "demo_body", "main"]

log = logging.getLogger("lemonkit.cli")

DEMO_QUESTION = "Why is the sky blue?"
_LEVELS = ("debug", "info", "warning", "error")
_USER_LIMITS = {
    "max_active": "model requests under way at once",
    "max_queued": "model requests waiting for their turn",
    "rate": "model requests per minute",
}


def demo_body(model: str, question: str) -> dict[str, Any]:
    """The text completion ``lemonkit run`` streams: a base model (no chat template) answers a question framed as
    a Q/A transcript, and ends at the end of its answer line instead of running on to ``max_tokens``."""
    return {
        "model": model,
        "prompt": f"Question: {question}\nAnswer:",
        "stop": ["\n", "Question:"],
        "repeat_penalty": 1.1,  # a small model repeats its sentence otherwise
        "max_tokens": 64,
        "temperature": 0,
        "stream": True,
    }


def chat_demo_body(model: str, question: str) -> dict[str, Any]:
    """The chat ``lemonkit run`` streams to an instruct model (one whose GGUF has a chat template)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 512,  # room for a whole answer: on some CPUs greedy SmolLM2 takes more than 256 tokens here
        "temperature": 0,
        "stream": True,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lemonkit", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("serve", "serve the API"), ("run", "serve, load a model and ask it one question")):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--host", default="127.0.0.1")
        cmd.add_argument("--port", type=int, default=DEFAULT_PORT)
        cmd.add_argument(
            "--log-level",
            choices=_LEVELS,
            type=str.lower,
            help="lemonkit logs at info by default and libraries (httpx, tornado, uvicorn) at warning; "
            "a level given here applies to both",
        )
        cmd.add_argument(
            "--allowed-hosts",
            metavar="NAMES",
            help="Host names accepted besides localhost and IP literals, comma-separated ('.example.com' for a "
            "domain, '*' for any: unsafe); default $LEMONKIT_ALLOWED_HOSTS",
        )
        cmd.add_argument(
            "--allowed-origins",
            metavar="ORIGINS",
            help="web page origins (http://host:port) allowed to call the API, with CORS, comma-separated; "
            "default $LEMONKIT_ALLOWED_ORIGINS",
        )
        for name, env in LiveLimits.ENV.items():
            cmd.add_argument(
                "--live-" + name.replace("_", "-"),
                type=int,
                metavar="N",
                help=f"bound of /v1/audio/transcriptions/live's body (0: none); default ${env}, else "
                f"{getattr(LiveLimits, name)}",
            )
        cmd.add_argument(
            "--remote-allowed-hosts",
            metavar="NAMES",
            help="hosts that remote models may name, comma-separated ('.example.com' for a domain, '*' for any); "
            "default $LEMONKIT_REMOTE_ALLOWED_HOSTS, else any",
        )
        cmd.add_argument(
            "--secrets-file",
            metavar="PATH",
            help="JSON or dotenv file of upstream keys for remote models' api_key_env; default $LEMONKIT_SECRETS_FILE",
        )
        cmd.add_argument(
            "--max-queue",
            type=int,
            metavar="N",
            help="model requests (all users) that may wait for a turn at one model; more are answered 503 at once "
            f"(0: no bound); default $LEMONKIT_MAX_QUEUE, else {DEFAULT_MAX_QUEUE}",
        )
        cmd.add_argument(
            "--max-loaded-models",
            type=int,
            metavar="N",
            help="a fixed count of models kept loaded per type (-1: none, memory decides); "
            "default $LEMONADE_MAX_LOADED_MODELS, else -1",
        )
        cmd.add_argument(
            "--memory",
            type=_size,
            metavar="SIZE",
            help="host memory lemonkit's models may take in all, e.g. 8GiB; default $LEMONKIT_MEMORY, else the "
            "machine's less a reserve",
        )
        for name, env in UserLimits.ENV.items():
            cmd.add_argument(
                "--user-" + name.replace("_", "-"),
                type=int,
                metavar="N",
                help=f"per-user limit: {_USER_LIMITS[name]} (0: none); default ${env}, else 0",
            )
    serve = sub.choices["serve"]
    serve.add_argument("--load", metavar="MODEL", help="load this model before serving")
    serve.add_argument(
        "--jupyterhub-service",
        action="store_true",
        help="serve as a JupyterHub managed service (c.JupyterHub.services): address and prefix from the hub's "
        "JUPYTERHUB_SERVICE_URL and JUPYTERHUB_SERVICE_PREFIX, hub tokens and OAuth; --host, --port and the "
        "browser options do not apply",
    )
    serve.add_argument(
        "--hub-admin-scope",
        metavar="SCOPE",
        help="with --jupyterhub-service: the hub scope that makes a user an admin of the service (hub admins "
        "always are); default $LEMONKIT_HUB_ADMIN_SCOPE, else custom:lemonkit:admin",
    )
    # lemonkit.client's embedded server: announces its port on stdout, exits when its stdin closes
    serve.add_argument("--embedded", action="store_true", help=argparse.SUPPRESS)
    run = sub.choices["run"]
    run.add_argument(
        "model", nargs="?", default=None, help="default: $LEMONKIT_DEFAULT_CHAT_MODEL, else the bundled SmolLM2"
    )
    run.add_argument("--prompt", default=DEMO_QUESTION, help="the question to ask")
    commands.add_parsers(sub)
    return parser


def _configure_logging(level: str | None, path: Path | None = None) -> None:
    """lemonkit at ``level`` (info by default), every other logger at warning unless ``level`` was given;
    to ``path`` or stderr, so nothing lands in what a command prints on stdout."""
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, mode="w", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=(level or "warning").upper(), handlers=[handler], force=True)
    logging.getLogger("lemonkit").setLevel((level or "info").upper())  # explicit: the log stream keeps this level


class _Demo:
    """Answers one question through the running server, streaming the text to stdout, in a thread beside the
    server; a failure stops the server (as Ctrl-C would) and is kept for :func:`main` to report."""

    def __init__(self, model: str, question: str, key: str | None, host: str) -> None:
        self.model, self.question, self.key, self.host = model, question, key, host
        self.error: BaseException | None = None

    def start(self, port: int) -> None:
        threading.Thread(target=self._run, args=(port,), daemon=True).start()

    def _run(self, port: int) -> None:
        from lemonkit.serving.server_records import local_url

        try:
            self._answer(local_url(self.host, port))
        except Exception as exc:
            self.error = exc
            os.kill(os.getpid(), signal.SIGINT)

    def _answer(self, url: str) -> None:
        from lemonkit.client import Client

        with Client(url, token=self.key) as client:
            chat = self._has_chat_template(client)
            path, body = ("chat/completions", chat_demo_body) if chat else ("completions", demo_body)
            print(f"\n{self.question}\n", end="", flush=True)
            finish = None
            for event in client.events(path, body(self.model, self.question)):
                for choice in event.data.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    print(text or "", end="", flush=True)
                    finish = choice.get("finish_reason") or finish
            stats = client.request("GET", "stats")
            cut = "; cut at max_tokens" if finish == "length" else ""
            print(f"\n\n[{stats['output_tokens']} tokens at {stats['tokens_per_second']:.1f} tok/s{cut}]")
            print(f"Serving {self.model} at {client.server.api} (OpenAI-compatible). Ctrl-C stops.", flush=True)

    def _has_chat_template(self, client: Any) -> bool:
        """Whether the loaded model's GGUF carries a chat template (this process serves it: its files are local)."""
        from lemonkit.formats.gguf_header import gguf_has_key

        files = client.request("GET", f"models/{quote(self.model, safe='')}/files", params={"include_paths": "true"})
        main = next((f for f in files["files"] if f["role"] == "main" and f["exists"]), None)
        return main is not None and gguf_has_key(main["path"], "tokenizer.chat_template")


def _announce(port: int) -> None:
    print(json.dumps({"port": port}), flush=True)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _remote_settings(args: argparse.Namespace) -> RemoteSettings:
    """The remote recipe's settings: the environment's, with the flags given winning."""
    settings = RemoteSettings()
    if args.remote_allowed_hosts is not None:
        hosts = tuple(h.strip() for h in args.remote_allowed_hosts.split(",") if h.strip())
        settings = dataclasses.replace(settings, allowed_hosts=hosts)
    if args.secrets_file:
        settings = dataclasses.replace(settings, secrets_file=Path(args.secrets_file).expanduser())
    return settings


def _serve(args: argparse.Namespace) -> int:
    from lemonkit.server.standalone import serve

    limits = LiveLimits.from_env(**{name: getattr(args, "live_" + name) for name in LiveLimits.ENV})
    users = UserLimits.from_env(**{name: getattr(args, "user_" + name) for name in UserLimits.ENV})
    settings = Settings(live_limits=limits, user_limits=users, remote=_remote_settings(args))
    if args.max_queue is not None:
        settings = dataclasses.replace(settings, max_queue=args.max_queue)
    if args.max_loaded_models is not None:
        settings = dataclasses.replace(settings, max_loaded_models=args.max_loaded_models)
    if args.memory is not None:
        settings = dataclasses.replace(settings, memory=args.memory)
    browsers = {"allowed_hosts": args.allowed_hosts, "allowed_origins": args.allowed_origins}
    if args.command == "serve" and args.jupyterhub_service:
        _configure_logging(args.log_level)
        from lemonkit.server import jupyterhub

        if args.hub_admin_scope:
            settings.hub_admin_scope = args.hub_admin_scope
        asyncio.run(jupyterhub.serve(jupyterhub.HubSettings.from_env(), settings, preload=args.load))
        return 0
    if args.command == "serve":
        _configure_logging(args.log_level)
        announce = _announce if args.embedded else None
        coroutine = serve(
            host=args.host,
            port=args.port,
            settings=settings,
            preload=args.load,
            ready=announce,
            until_stdin_closes=args.embedded,
            **browsers,
        )
        asyncio.run(coroutine)
        return 0
    path = settings.cache_dir / "logs" / "lemonkit-run.log"
    _configure_logging(args.log_level, path)
    print(f"lemonkit run: the server's log is in {path}", file=sys.stderr, flush=True)
    model = args.model or default_chat_model()
    demo = _Demo(model, args.prompt, settings.api_key, args.host)
    try:
        asyncio.run(
            serve(host=args.host, port=args.port, settings=settings, preload=model, ready=demo.start, **browsers)
        )
    except KeyboardInterrupt:
        pass  # Ctrl-C, or the demo stopping the server
    if demo.error is not None:
        raise demo.error
    return 0


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command in commands.COMMANDS:
        sys.exit(commands.run(args))
    try:
        status = _serve(args)
    except KeyboardInterrupt:
        status = 0
    except Exception as exc:
        log.debug("%s failed", args.command, exc_info=True)
        print(f"lemonkit {args.command}: {commands.describe(exc)}", file=sys.stderr)
        status = 2
    sys.exit(status)


if __name__ == "__main__":
    main()

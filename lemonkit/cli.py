"""The ``lemonkit`` command.

- ``lemonkit serve [--host H] [--port P] [--load MODEL]``: the standalone server.
- ``lemonkit run [MODEL]``: serve, load the model (the bundled default offline), continue one prompt, keep serving.
- ``lemonkit pull|list|delete|load|unload|variants``: manage models on a running server (``LEMONKIT_URL``);
  see :mod:`lemonkit.commands`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading

from lemonkit import commands
from lemonkit.config import DEFAULT_MODEL, DEFAULT_PORT, Settings

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lemonkit", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("serve", "serve the API"), ("run", "serve, load a model and chat with it once")):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--host", default="127.0.0.1")
        cmd.add_argument("--port", type=int, default=DEFAULT_PORT)
        cmd.add_argument("--log-level", default="info")
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
    serve = sub.choices["serve"]
    serve.add_argument("--load", metavar="MODEL", help="load this model before serving")
    # lemonkit.client's embedded server: announces its port on stdout, exits when its stdin closes
    serve.add_argument("--embedded", action="store_true", help=argparse.SUPPRESS)
    run = sub.choices["run"]
    run.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    run.add_argument("--prompt", default="The three primary colors are red,")
    commands.add_parsers(sub)
    return parser


def _demo(port: int, model: str, prompt: str) -> None:
    """Continue ``prompt`` through the running server's OpenAI route, streaming the text as it comes.

    A text completion, not a chat: the embedded default is a base model.
    """
    import httpx

    api = f"http://127.0.0.1:{port}/api/v1"
    body = {"model": model, "prompt": prompt, "stream": True, "max_tokens": 40, "temperature": 0}
    print(f"\n{prompt}", end="", flush=True)
    with httpx.stream("POST", f"{api}/completions", json=body, timeout=None) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                print(choices[0].get("text") or "", end="", flush=True)
    stats = httpx.get(f"{api}/stats").json()
    print(f"\n\n[{stats['output_tokens']} tokens at {stats['tokens_per_second']:.1f} tok/s]")
    print(f"Serving {model} at {api} (OpenAI-compatible). Ctrl-C stops.", flush=True)


def _announce(port: int) -> None:
    print(json.dumps({"port": port}), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command in commands.COMMANDS:
        sys.exit(commands.run(args))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lemonkit").setLevel(args.log_level.upper())  # explicit, so the log stream keeps this level
    from lemonkit.server.standalone import serve

    try:
        settings = Settings()
    except ValueError as exc:
        print(f"lemonkit {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)
    browsers = {"allowed_hosts": args.allowed_hosts, "allowed_origins": args.allowed_origins}
    if args.command == "serve":
        announce = _announce if args.embedded else None
        asyncio.run(
            serve(
                host=args.host,
                port=args.port,
                settings=settings,
                preload=args.load,
                ready=announce,
                until_stdin_closes=args.embedded,
                **browsers,
            )
        )
        return

    def ready(port: int) -> None:
        threading.Thread(target=_demo, args=(port, args.model, args.prompt), daemon=True).start()

    try:
        asyncio.run(
            serve(host=args.host, port=args.port, settings=settings, preload=args.model, ready=ready, **browsers)
        )
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()

"""The ``lemonkit`` command.

- ``lemonkit serve [--host H] [--port P] [--load MODEL]``: the standalone server.
- ``lemonkit run [MODEL]``: serve, load the model (the bundled default offline), answer one prompt, keep serving.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading

from lemonkit.config import DEFAULT_MODEL, DEFAULT_PORT

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
    sub.choices["serve"].add_argument("--load", metavar="MODEL", help="load this model before serving")
    run = sub.choices["run"]
    run.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    run.add_argument("--prompt", default="The three primary colors are")
    return parser


def _demo(port: int, model: str, prompt: str) -> None:
    """Ask the running server one question through its OpenAI route, streaming the answer."""
    import json

    import httpx

    url = f"http://127.0.0.1:{port}/api/v1/chat/completions"
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": 48}
    print(f"\n> {prompt}\n", flush=True)
    with httpx.stream("POST", url, json=body, timeout=None) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"] if "choices" in line else {}
                print(delta.get("content") or "", end="", flush=True)
    print(f"\n\nServing {model} at http://127.0.0.1:{port}/api/v1 (OpenAI-compatible). Ctrl-C stops.", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lemonkit.server.standalone import serve

    if args.command == "serve":
        asyncio.run(serve(host=args.host, port=args.port, preload=args.load))
        return

    def ready(port: int) -> None:
        threading.Thread(target=_demo, args=(port, args.model, args.prompt), daemon=True).start()

    try:
        asyncio.run(serve(host=args.host, port=args.port, preload=args.model, ready=ready))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()

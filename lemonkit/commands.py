"""``lemonkit status|pull|list|delete|load|unload|variants``: model management through :class:`lemonkit.Client`.

The server is found as :mod:`lemonkit.client` describes: ``LEMONKIT_URL`` (with ``LEMONKIT_TOKEN`` or
``LEMONADE_API_KEY``; a Jupyter token works too), else a ``lemonkit serve`` on port 13305, else an embedded server
that lives for the one command (``status``, ``load`` and ``unload`` are about a server that outlives them, so they
start none). Under JupyterHub the hub's lemonkit service comes before any local server (``status`` says
``jupyterhub``).
Exit status: 0 done, 2 an error (the server refused, or there is none; one line on stderr, no traceback),
130 interrupted (a pull pauses on the server and the same command resumes it).
"""

from __future__ import annotations

import argparse
import errno
import sys
from typing import Any

import httpx

from lemonkit.api import pull
from lemonkit.client import Client
from lemonkit.errors import LemonkitError, ServerUnavailable

__all__ = ["COMMANDS", "add_parsers", "describe", "run", "status_lines"]

COMMANDS = ("status", "pull", "list", "delete", "load", "unload", "variants")
#: commands about a server that outlives them: they never start the embedded one
_NO_START = ("status", "load", "unload")


def add_parsers(sub: Any) -> None:
    sub.add_parser("status", help="the server this user's clients reach, how it was found, and what it has loaded")
    pull = sub.add_parser("pull", help="download a model (a registered name, or owner/repo[:variant] from the hub)")
    pull.add_argument("model", help="a model name, user.<name> with --checkpoint, or owner/repo[:variant]")
    pull.add_argument("--checkpoint", help="register MODEL (user.<name>) on this repo:variant")
    pull.add_argument("--recipe", default="llamacpp")
    pull.add_argument("--mmproj", help="the vision projector file in the checkpoint's repo")
    for flag in ("reasoning", "vision", "embedding", "reranking"):
        pull.add_argument(f"--{flag}", action="store_true")
    pull.add_argument(
        "--remote-url",
        action="append",
        metavar="URL",
        help="register MODEL as served by this OpenAI base URL (recipe remote; repeat for several)",
    )
    pull.add_argument("--api-key-env", metavar="VAR", help="the server's variable holding the remote upstream's key")
    listing = sub.add_parser("list", help="models on the server")
    listing.add_argument("--all", action="store_true", help="also those not downloaded")
    sub.add_parser("delete", help="delete a model's files (and a user model's entry)").add_argument("model")
    load = sub.add_parser("load", help="load a model")
    load.add_argument("model")
    load.add_argument("--ctx-size", type=int)
    sub.add_parser("unload", help="unload a model (all without a name)").add_argument("model", nargs="?")
    sub.add_parser("variants", help="the GGUF variants of a hub repo").add_argument("checkpoint")


def _pull(client: Client, args: argparse.Namespace) -> None:
    flags = {f: getattr(args, f) for f in ("reasoning", "vision", "embedding", "reranking")}
    registration = {"checkpoint": args.checkpoint, "recipe": args.recipe, "mmproj": args.mmproj, **flags}
    urls = args.remote_url or []
    registration.update(
        remote_url=urls[0] if len(urls) == 1 else None,
        remote_urls=urls if len(urls) > 1 else None,
        api_key_env=args.api_key_env,
    )
    model = pull(args.model, **registration, file=sys.stderr, client=client)
    print(f"Installed model: {model['id']}")


def _list(client: Client, args: argparse.Namespace) -> None:
    models = client.models(show_all=args.all)
    width = max([len(m["id"]) for m in models] + [5])
    print(f"{'model':<{width}}  {'downloaded':<10}  {'size':>8}  labels")
    for m in models:
        size = f"{m['size']:.2f} GB" if m.get("size") else ""
        flag = "yes" if m["downloaded"] else "no"
        if m.get("update_available"):
            flag += " (update)"
        print(f"{m['id']:<{width}}  {flag:<10}  {size:>8}  {', '.join(m['labels'])}")


def _variants(client: Client, args: argparse.Namespace) -> None:
    info = client.variants(args.checkpoint)
    print(f"{info['checkpoint']} (recipe {info['recipe']}, suggested name user.{info['suggested_name']})")
    for v in info["variants"]:
        shards = f", {len(v['files'])} shards" if v["sharded"] else ""
        print(f"  {v['name']:<14} {v['size_bytes'] / 1e9:8.2f} GB  {v['primary_file']}{shards}")
    if info["mmproj_files"]:
        print(f"  mmproj: {', '.join(info['mmproj_files'])}")
    if info["suggested_labels"]:
        print(f"  labels: {', '.join(info['suggested_labels'])}")


def status_lines(client: Client) -> list[str]:
    """What ``lemonkit status`` and ``%lemonkit status`` print: the server, how it was found, its loaded models."""
    health = client.health()
    server = client.server
    loaded = [f"{m['model_name']} ({m['type']}, pid {m['pid']})" for m in health["all_models_loaded"]]
    return [
        f"lemonkit {health['version']} at {server.api} ({server.kind})",
        "loaded: " + (", ".join(loaded) or "nothing"),
    ]


def _call(client: Client, args: argparse.Namespace) -> None:
    if args.command == "status":
        print("\n".join(status_lines(client)))
    elif args.command == "pull":
        _pull(client, args)
    elif args.command == "list":
        _list(client, args)
    elif args.command == "variants":
        _variants(client, args)
    elif args.command == "delete":
        print(client.delete(args.model)["message"])
    elif args.command == "load":
        options = {"ctx_size": args.ctx_size} if args.ctx_size is not None else {}
        print(client.load(args.model, **options)["message"])
    elif args.command == "unload":
        print(client.unload(args.model)["message"])


def describe(exc: BaseException) -> str:
    """One line for a person about what failed."""
    if isinstance(exc, ServerUnavailable):
        text = str(exc)
    elif isinstance(exc, LemonkitError):
        text = f"{exc.status}: {exc}" if exc.status else str(exc)
    elif isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        text = f"the port is already in use ({exc}); pick another with --port"
    elif isinstance(exc, httpx.HTTPError):
        text = f"HTTP failure ({type(exc).__name__}: {exc})"
    elif isinstance(exc, (OSError, ValueError)):
        text = str(exc)
    else:
        text = f"unexpected error ({type(exc).__name__}: {exc})"
    return " ".join(text.split())


def run(args: argparse.Namespace) -> int:
    """Run one client command; returns the exit status."""
    client = Client(start=args.command not in _NO_START)
    try:
        with client:
            if client.server.kind == "embedded":
                print("lemonkit: no server running; this command runs its own", file=sys.stderr)
            _call(client, args)
    except KeyboardInterrupt:
        if args.command == "pull":
            print("\nInterrupted: the download is paused; the same command resumes it.", file=sys.stderr)
        return 130
    except Exception as exc:
        hint = ""
        if isinstance(exc, ServerUnavailable) and args.command == "load":
            hint = f" (or `lemonkit serve --load {args.model}`)"
        print(f"lemonkit {args.command}: {describe(exc)}{hint}", file=sys.stderr)
        return 2
    return 0

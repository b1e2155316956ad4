"""``lemonkit pull|list|delete|load|unload|variants``: model management against a running server.

The server is ``LEMONKIT_URL`` (a host root such as ``http://127.0.0.1:13305`` or a Jupyter server's
``http://host:8888/lemonkit``, or a full ``.../api/v1``), default ``http://127.0.0.1:13305``; the key is
``LEMONKIT_TOKEN`` or ``LEMONADE_API_KEY`` (a Jupyter token works too). Exit status: 0 done, 1 the server
refused, 2 no server, 130 interrupted (a pull pauses on the server and the same command resumes it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import httpx

from lemonkit.config import DEFAULT_PORT

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("pull", "list", "delete", "load", "unload", "variants")


def api_url() -> str:
    url = os.environ.get("LEMONKIT_URL", f"http://127.0.0.1:{DEFAULT_PORT}").rstrip("/")
    return url if re.search(r"/(api/)?v[01]$", url) else url + "/api/v1"


def _client() -> httpx.Client:
    key = os.environ.get("LEMONKIT_TOKEN") or os.environ.get("LEMONADE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=api_url() + "/", headers=headers, timeout=httpx.Timeout(60, read=None))


def add_parsers(sub: Any) -> None:
    pull = sub.add_parser("pull", help="download a model (a registered name, or owner/repo[:variant] from the hub)")
    pull.add_argument("model", help="a model name, user.<name> with --checkpoint, or owner/repo[:variant]")
    pull.add_argument("--checkpoint", help="register MODEL (user.<name>) on this repo:variant")
    pull.add_argument("--recipe", default="llamacpp")
    pull.add_argument("--mmproj", help="the vision projector file in the checkpoint's repo")
    for flag in ("reasoning", "vision", "embedding", "reranking"):
        pull.add_argument(f"--{flag}", action="store_true")
    listing = sub.add_parser("list", help="models on the server")
    listing.add_argument("--all", action="store_true", help="also those not downloaded")
    sub.add_parser("delete", help="delete a model's files (and a user model's entry)").add_argument("model")
    load = sub.add_parser("load", help="load a model")
    load.add_argument("model")
    load.add_argument("--ctx-size", type=int)
    sub.add_parser("unload", help="unload a model (all without a name)").add_argument("model", nargs="?")
    sub.add_parser("variants", help="the GGUF variants of a hub repo").add_argument("checkpoint")


class _Refused(Exception):
    pass


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        raise _Refused(f"{response.status_code}: {message}")
    return response.json()


def _events(response: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    name = "message"
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])
            name = "message"


def _pull_body(client: httpx.Client, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model_name": args.model, "stream": True}
    flags = {f: True for f in ("reasoning", "vision", "embedding", "reranking") if getattr(args, f)}
    if args.checkpoint:
        return {**body, "checkpoint": args.checkpoint, "recipe": args.recipe, "mmproj": args.mmproj, **flags}
    if "/" not in args.model:
        return body
    # owner/repo[:variant]: register it as user.<repo name>, the way the hub's metadata suggests
    repo, _, variant = args.model.partition(":")
    info = _check(client.get("pull/variants", params={"checkpoint": repo}))
    if not variant:
        if not info["variants"]:
            raise _Refused(f"{repo} has no GGUF variant; name one with {repo}:<file>")
        variant = info["variants"][0]["name"]
    labels = info["suggested_labels"]
    body.update(model_name=f"user.{info['suggested_name']}", checkpoint=f"{repo}:{variant}", recipe=info["recipe"])
    body.update(vision="vision" in labels, embedding="embeddings" in labels, reranking="reranking" in labels)
    if "vision" in labels and info["mmproj_files"]:
        body["mmproj"] = info["mmproj_files"][0]
    return {**body, **flags}


def _pull(client: httpx.Client, args: argparse.Namespace) -> None:
    from tqdm import tqdm

    body = {k: v for k, v in _pull_body(client, args).items() if v is not None}
    name = body["model_name"]
    with client.stream("POST", "pull", json=body) as response:
        if response.status_code >= 400:
            response.read()
            _check(response)
        with tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=name, file=sys.stderr) as bar:
            for event, data in _events(response):
                if event == "progress":
                    bar.total = data.get("total_download_size") or bar.total
                    bar.n = data.get("cumulative_bytes_downloaded", bar.n)
                    bar.set_postfix_str(f"{data['file_index']}/{data['total_files']} {data['file']}", refresh=False)
                    bar.refresh()
                elif event == "complete":
                    bar.n = bar.total
                    bar.refresh()
                    break
                elif event == "error":
                    raise _Refused(data.get("error", "the download failed"))
            else:
                raise _Refused("the server ended the stream before the download finished")
    print(f"Installed model: {name}")


def _list(client: httpx.Client, args: argparse.Namespace) -> None:
    models = _check(client.get("models", params={"show_all": "true"} if args.all else {}))["data"]
    width = max([len(m["id"]) for m in models] + [5])
    print(f"{'model':<{width}}  {'downloaded':<10}  {'size':>8}  labels")
    for m in models:
        size = f"{m['size']:.2f} GB" if m.get("size") else ""
        flag = "yes" if m["downloaded"] else "no"
        if m.get("update_available"):
            flag += " (update)"
        print(f"{m['id']:<{width}}  {flag:<10}  {size:>8}  {', '.join(m['labels'])}")


def _variants(client: httpx.Client, args: argparse.Namespace) -> None:
    info = _check(client.get("pull/variants", params={"checkpoint": args.checkpoint}))
    print(f"{info['checkpoint']} (recipe {info['recipe']}, suggested name user.{info['suggested_name']})")
    for v in info["variants"]:
        shards = f", {len(v['files'])} shards" if v["sharded"] else ""
        print(f"  {v['name']:<14} {v['size_bytes'] / 1e9:8.2f} GB  {v['primary_file']}{shards}")
    if info["mmproj_files"]:
        print(f"  mmproj: {', '.join(info['mmproj_files'])}")
    if info["suggested_labels"]:
        print(f"  labels: {', '.join(info['suggested_labels'])}")


def run(args: argparse.Namespace) -> int:
    """Run one client command; returns the exit status."""
    try:
        with _client() as client:
            if args.command == "pull":
                _pull(client, args)
            elif args.command == "list":
                _list(client, args)
            elif args.command == "variants":
                _variants(client, args)
            elif args.command == "delete":
                print(_check(client.post("delete", json={"model_name": args.model}))["message"])
            elif args.command == "load":
                body = {"model_name": args.model, "ctx_size": args.ctx_size}
                print(_check(client.post("load", json={k: v for k, v in body.items() if v is not None}))["message"])
            elif args.command == "unload":
                print(_check(client.post("unload", json={"model_name": args.model} if args.model else {}))["message"])
    except _Refused as exc:
        print(f"lemonkit {args.command}: {exc}", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:
        print(
            f"lemonkit {args.command}: no lemonkit server at {api_url()} ({exc}); start one with `lemonkit serve` "
            "or set LEMONKIT_URL",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        if args.command == "pull":
            print("\nInterrupted: the download is paused on the server; the same command resumes it.", file=sys.stderr)
        return 130
    return 0

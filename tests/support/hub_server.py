"""A local HTTP server speaking enough of the Hugging Face hub protocol for ``huggingface_hub`` and lemonkit pulls.

Serves repos the tests build (file contents from bytes or files on disk) through the routes huggingface_hub 2.4
calls: model info (``/api/models/{repo}[/revision/{rev}]``, ``?blobs=true`` adds sizes and LFS metadata), the tree
listing (``/api/models/{repo}/tree/{rev}[/{path}]``, ``?recursive=true``) and ``/{repo}/resolve/{rev}/{path}``
(HEAD and GET with ETag, X-Repo-Commit, X-Linked-Size/Etag, Content-Length and Range). Errors carry the
``X-Error-Code`` header huggingface_hub maps to its exception classes.

Faults a test can inject: a throttle (bytes/s), a hold (stop sending a file at byte N until released: the test
then knows exactly what the client has), a dropped connection after N bytes of a response, and a required token.
A hostile hub is a repo whose file names are anything (``../x.gguf``: the listing serves them as given) or whose
files all answer with one forged ETag (``add_repo(..., etag="../../y")``).
Every response is logged with the Range it answered and the body bytes it sent.

In-process: ``with HubServer() as hub: ...``. As a subprocess (benchmarks): ``python tests/support/hub_server.py --repo
owner/name=DIR`` prints ``hub serving on URL`` and takes the same controls as JSON on ``POST /_hub/control``;
``GET /_hub/log`` returns the log.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import parse_qs, quote, unquote, urlsplit

__all__ = ["HubFile", "HubServer", "Served", "tiny_gguf_repo"]

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_BLOCK = 64 * 1024


@dataclass(frozen=True)
class HubFile:
    """One file of a commit: where its bytes are and the hashes the hub reports."""

    path: str
    data: Path
    size: int
    sha256: str
    git_oid: str
    lfs: bool

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class _Repo:
    id: str
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    main: str = ""
    token: str | None = None
    cdn: bool = False
    etag: str | None = None


@dataclass
class Served:
    """One answered request; ``sent`` grows while a body streams."""

    method: str
    path: str
    status: int
    range_start: int | None = None
    sent: int = 0
    file: str | None = None
    repo: str | None = None
    auth: bool = False


def _hash_file(path: Path) -> tuple[str, str, int]:
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    git = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            sha256.update(block)
            git.update(block)
    return sha256.hexdigest(), git.hexdigest(), size


class HubServer:
    """The hub, listening on 127.0.0.1 (API and resolve) and reachable as ``localhost`` (the "CDN" host).

    Args:
        root: Where file contents given as bytes are stored (a temp dir when omitted, removed on stop).
        port: TCP port (0: a free one).
    """

    def __init__(self, root: Path | None = None, port: int = 0) -> None:
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="hub-"))
        self._repos: dict[str, _Repo] = {}
        self._lock = threading.Condition()
        self.throttle: int | None = None
        #: answer Range requests with the whole file (200), as some proxies do
        self.ignore_range = False
        self._hold: tuple[str | None, int] | None = None
        self._released = threading.Event()
        self.held = threading.Event()
        self._drop: tuple[str | None, int, int] | None = None
        self._fail: tuple[int, int] | None = None
        self.log: list[Served] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _make_handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn_url(self) -> str:
        # another host name for the same socket: huggingface_hub treats it as a CDN (no auth, no redirect follow)
        return f"http://localhost:{self.port}"

    def start(self) -> HubServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- repos -------------------------------------------------------------------------------------------------------

    def _store(self, content: bytes | Path) -> Path:
        if isinstance(content, Path):
            return content
        digest = hashlib.sha256(content).hexdigest()
        path = self.root / "objects" / digest
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(content)
            os.replace(tmp, path)
        return path

    def _file(self, name: str, content: bytes | Path, lfs: bool | None) -> HubFile:
        data = self._store(content)
        sha256, git_oid, size = _hash_file(data)
        if lfs is None:
            lfs = name.lower().endswith(".gguf") or size > (1 << 20)
        return HubFile(path=name, data=data, size=size, sha256=sha256, git_oid=git_oid, lfs=lfs)

    def add_repo(
        self,
        repo_id: str,
        files: Mapping[str, bytes | Path],
        *,
        token: str | None = None,
        cdn: bool = False,
        lfs: bool | None = None,
        etag: str | None = None,
    ) -> str:
        """Create (or replace) a repo with one commit; returns the commit sha.

        Args:
            repo_id: ``owner/name``.
            files: Repo path -> content (bytes, or a file on disk served in place).
            token: Requests must send ``Authorization: Bearer <token>`` (a gated repo).
            cdn: LFS files resolve with a 302 to the CDN host, as huggingface.co does.
            lfs: Force LFS on or off for every file (default: ``.gguf`` and files over 1 MiB are LFS).
            etag: Send this ETag (and ``X-Linked-Etag``) for every file instead of its hash: a hostile hub.
        """
        repo = _Repo(id=repo_id, token=token, cdn=cdn, etag=etag)
        with self._lock:
            self._repos[repo_id] = repo
        return self.commit(repo_id, files, lfs=lfs)

    def commit(self, repo_id: str, changes: Mapping[str, bytes | Path | None], *, lfs: bool | None = None) -> str:
        """Add a commit on ``main`` changing files (``None`` deletes one); returns its sha."""
        with self._lock:
            repo = self._repos[repo_id]
            files = dict(repo.commits.get(repo.main, {}))
        for name, content in changes.items():
            if content is None:
                files.pop(name, None)
            else:
                files[name] = self._file(name, content, lfs)
        digest = hashlib.sha1(repo.main.encode())
        for name in sorted(files):
            digest.update(f"{name}\0{files[name].git_oid}\n".encode())
        sha = digest.hexdigest()
        with self._lock:
            repo.commits[sha] = files
            repo.main = sha
        return sha

    def head(self, repo_id: str) -> str:
        return self._repos[repo_id].main

    def file(self, repo_id: str, path: str) -> HubFile:
        repo = self._repos[repo_id]
        return repo.commits[repo.main][path]

    # -- faults ------------------------------------------------------------------------------------------------------

    def hold(self, at: int, path: str | None = None) -> None:
        """Stop every response for ``path`` (any file when None) at absolute byte ``at`` until :meth:`release`."""
        with self._lock:
            self._released.clear()
            self.held.clear()
            self._hold = (path, at)

    def release(self) -> None:
        with self._lock:
            self._hold = None
            self._released.set()

    def drop(self, after: int, path: str | None = None, times: int = 1) -> None:
        """Cut the connection of the next ``times`` responses for ``path`` after ``after`` body bytes."""
        with self._lock:
            self._drop = (path, after, times)

    def fail(self, status: int, times: int = 1) -> None:
        """Answer the next ``times`` API (``/api/...``) requests with ``status``."""
        with self._lock:
            self._fail = (status, times) if times > 0 else None

    def reset(self) -> None:
        """No throttle, hold, drop or failure."""
        self.release()
        with self._lock:
            self.throttle = None
            self.ignore_range = False
            self._drop = None
            self._fail = None

    def _take_fail(self) -> int | None:
        with self._lock:
            if self._fail is None:
                return None
            status, times = self._fail
            self._fail = (status, times - 1) if times > 1 else None
            return status

    def served(self, path: str, repo: str | None = None, method: str = "GET") -> list[Served]:
        """The responses that sent (some of) file ``path`` (of ``repo``, when given)."""
        with self._lock:
            return [s for s in self.log if s.file == path and s.method == method and (repo is None or s.repo == repo)]

    def bytes_served(self, path: str, repo: str | None = None) -> int:
        return sum(s.sent for s in self.served(path, repo))

    def control(self, body: dict[str, Any]) -> None:
        """The JSON controls of ``POST /_hub/control`` (subprocess mode)."""
        if "throttle" in body:
            self.throttle = body["throttle"]
        if body.get("hold"):
            self.hold(int(body["hold"]["at"]), body["hold"].get("path"))
        if body.get("release"):
            self.release()
        if body.get("drop"):
            self.drop(int(body["drop"]["after"]), body["drop"].get("path"), int(body["drop"].get("times", 1)))
        if body.get("fail"):
            self.fail(int(body["fail"]["status"]), int(body["fail"].get("times", 1)))
        if body.get("clear_log"):
            with self._lock:
                self.log.clear()

    # -- serving helpers (called from request threads) ---------------------------------------------------------------

    def _lookup(self, repo_id: str) -> _Repo | None:
        with self._lock:
            return self._repos.get(repo_id)

    def _take_drop(self, path: str) -> int | None:
        with self._lock:
            if self._drop is None or (self._drop[0] is not None and self._drop[0] != path):
                return None
            target, after, times = self._drop
            self._drop = (target, after, times - 1) if times > 1 else None
            return after

    def _hold_at(self, path: str) -> int | None:
        with self._lock:
            if self._hold is None or (self._hold[0] is not None and self._hold[0] != path):
                return None
            return self._hold[1]

    def _record(self, entry: Served) -> Served:
        with self._lock:
            self.log.append(entry)
        return entry


def _peer_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _json_dumps(data: Any) -> bytes:
    return json.dumps(data).encode()


def _make_handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "lemonkit-test-hub"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        # -- plumbing ----------------------------------------------------------------------------------------------

        def _send(self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if "Content-Type" not in (headers or {}):
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            hub._record(Served(self.command, self.path, status, auth="Authorization" in self.headers))

        def _error(self, status: int, code: str, message: str, extra: Mapping[str, str] | None = None) -> None:
            headers = {"X-Error-Code": code, "X-Error-Message": message, **(extra or {})}
            self._send(status, _json_dumps({"error": message}), headers)

        def _repo(self, repo_id: str) -> _Repo | None:
            repo = hub._lookup(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                self._error(401, "GatedRepo", "Access to this repository is restricted")
                return None
            return repo

        def _commit(self, repo: _Repo, revision: str) -> tuple[str, dict[str, HubFile]] | None:
            sha = repo.main if revision == "main" else revision
            files = repo.commits.get(sha)
            if files is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return None
            return sha, files

        # -- routes ------------------------------------------------------------------------------------------------

        def do_GET(self) -> None:
            self._route()

        def do_HEAD(self) -> None:
            self._route()

        def do_POST(self) -> None:
            if urlsplit(self.path).path == "/_hub/control":
                length = int(self.headers.get("Content-Length") or 0)
                hub.control(json.loads(self.rfile.read(length) or b"{}"))
                self._send(200, b"{}")
            else:
                self._error(404, "NotFound", "no such route")

        def _route(self) -> None:
            parts = urlsplit(self.path)
            path = unquote(parts.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            try:
                if path == "/_hub/log":
                    with hub._lock:
                        log = [asdict(s) for s in hub.log]
                    self._send(200, _json_dumps(log))
                elif path.startswith("/api/") and (failure := hub._take_fail()) is not None:
                    self._error(failure, "Injected", f"injected failure {failure}")
                elif path.startswith("/api/models/"):
                    self._api(path[len("/api/models/") :], query)
                elif path.startswith("/_cdn/"):
                    self._cdn(path[len("/_cdn/") :])
                elif "/resolve/" in path:
                    repo_id, _, rest = path.lstrip("/").partition("/resolve/")
                    revision, _, name = rest.partition("/")
                    self._resolve(repo_id, revision, name)
                else:
                    self._error(404, "NotFound", "no such route")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _api(self, rest: str, query: Mapping[str, str]) -> None:
            segments = rest.split("/")
            repo_id = "/".join(segments[:2])
            tail = segments[2:]
            repo = self._repo(repo_id)
            if repo is None:
                return
            if not tail or tail[0] == "revision":
                found = self._commit(repo, tail[1] if len(tail) > 1 else "main")
                if found is not None:
                    self._info(repo, *found, blobs=query.get("blobs", "").lower() in ("1", "true"))
            elif tail[0] == "tree" and len(tail) > 1:
                found = self._commit(repo, tail[1])
                if found is not None:
                    recursive = query.get("recursive", "").lower() in ("1", "true")
                    self._tree(found[1], "/".join(tail[2:]).strip("/"), recursive)
            else:
                self._error(404, "NotFound", "no such route")

        def _info(self, repo: _Repo, sha: str, files: dict[str, HubFile], *, blobs: bool) -> None:
            siblings = []
            for name in sorted(files):
                entry: dict[str, Any] = {"rfilename": name}
                if blobs:
                    f = files[name]
                    entry.update(size=f.size, blobId=f.git_oid)
                    if f.lfs:
                        entry["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
                siblings.append(entry)
            body = {
                "_id": hashlib.md5(repo.id.encode()).hexdigest()[:24],
                "id": repo.id,
                "modelId": repo.id,
                "author": repo.id.split("/")[0],
                "sha": sha,
                "private": False,
                "gated": "manual" if repo.token else False,
                "disabled": False,
                "tags": ["gguf"],
                "library_name": "gguf",
                "siblings": siblings,
            }
            self._send(200, _json_dumps(body))

        def _tree(self, files: dict[str, HubFile], prefix: str, recursive: bool) -> None:
            under = [f for name, f in sorted(files.items()) if not prefix or name.startswith(prefix + "/")]
            if prefix and not under:
                self._error(404, "EntryNotFound", f"{prefix} does not exist")
                return
            entries: list[dict[str, Any]] = []
            folders: set[str] = set()
            for f in under:
                rel = f.path[len(prefix) + 1 :] if prefix else f.path
                dirs = rel.split("/")[:-1]
                for depth in range(1, len(dirs) + 1):
                    if not recursive and depth > 1:
                        break
                    folder = "/".join(filter(None, [prefix, *dirs[:depth]]))
                    if folder not in folders:
                        folders.add(folder)
                        oid = hashlib.sha1(folder.encode()).hexdigest()
                        entries.append({"type": "directory", "oid": oid, "size": 0, "path": folder})
                if dirs and not recursive:
                    continue
                entry: dict[str, Any] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.path}
                if f.lfs:
                    entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
                entries.append(entry)
            self._send(200, _json_dumps(entries))

        def _resolve(self, repo_id: str, revision: str, name: str) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            found = self._commit(repo, revision)
            if found is None:
                return
            sha, files = found
            f = files.get(name)
            if f is None:
                self._error(404, "EntryNotFound", f"{name} does not exist", {"X-Repo-Commit": sha})
                return
            headers = {"X-Repo-Commit": sha, "ETag": f'"{repo.etag or f.etag}"', "Accept-Ranges": "bytes"}
            if f.lfs:
                headers.update({"X-Linked-Etag": f'"{repo.etag or f.sha256}"', "X-Linked-Size": str(f.size)})
            if f.lfs and repo.cdn:
                headers["Location"] = f"{hub.cdn_url}/_cdn/{repo.id}/{sha}/{quote(f.path)}"
                self._send(302, b"", headers)
                return
            self._body(f, headers, repo.id)

        def _cdn(self, rest: str) -> None:
            owner, repo_name, sha, name = rest.split("/", 3)
            repo = hub._lookup(f"{owner}/{repo_name}")
            f = repo.commits.get(sha, {}).get(name) if repo is not None else None
            if f is None:
                self._error(404, "EntryNotFound", "no such object")
                return
            self._body(f, {"ETag": f'"{f.sha256}"', "Accept-Ranges": "bytes"}, f"{owner}/{repo_name}")

        def _body(self, f: HubFile, headers: dict[str, str], repo_id: str) -> None:
            start, end = 0, f.size - 1
            status = 200
            wanted = None if hub.ignore_range else self.headers.get("Range")
            if wanted:
                match = _RANGE_RE.match(wanted.strip())
                if match is None or (not match[1] and not match[2]):
                    self._error(416, "RangeNotSatisfiable", f"bad range {wanted!r}")
                    return
                if match[1]:
                    start = int(match[1])
                    end = min(int(match[2]), f.size - 1) if match[2] else f.size - 1
                else:  # a suffix: the last N bytes
                    start = max(f.size - int(match[2]), 0)
                if start >= f.size or start > end:
                    self._error(416, "RangeNotSatisfiable", "range not satisfiable", {"Content-Range": f"*/{f.size}"})
                    return
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
            length = end - start + 1
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(length))
            self.end_headers()
            entry = hub._record(
                Served(
                    self.command,
                    self.path,
                    status,
                    range_start=start if wanted else None,
                    auth="Authorization" in self.headers,
                )
            )
            entry.file, entry.repo = f.path, repo_id
            if self.command == "HEAD":
                return
            self.wfile.flush()
            with open(f.data, "rb") as source:
                source.seek(start)
                self._stream(source, f.path, start, length, entry)

        def _stream(self, source: BinaryIO, path: str, start: int, length: int, entry: Served) -> None:
            drop_after = hub._take_drop(path)
            sock = self.connection
            if hub.throttle is None and drop_after is None and hub._hold_at(path) is None:
                # the fast path: the kernel copies the file (benchmarks measure the client, not this server)
                entry.sent = sock.sendfile(source, start, length)
                return
            began = time.monotonic()
            offset = start
            while entry.sent < length:
                hold = hub._hold_at(path)
                block = min(_BLOCK, length - entry.sent)
                if hub.throttle:
                    block = min(block, max(1024, hub.throttle // 50))
                if hold is not None and offset < hold:
                    block = min(block, hold - offset)
                elif hold is not None and offset == hold:
                    hub.held.set()
                    hub._released.wait(60)
                    if _peer_closed(sock):  # the client gave up while held: what follows would go nowhere
                        self.close_connection = True
                        return
                    continue
                if drop_after is not None:
                    if entry.sent >= drop_after:
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                        self.close_connection = True
                        return
                    block = min(block, drop_after - entry.sent)
                data = source.read(block)
                sock.sendall(data)
                entry.sent += len(data)
                offset += len(data)
                if hub.throttle:
                    ahead = entry.sent / hub.throttle - (time.monotonic() - began)
                    if ahead > 0:
                        time.sleep(ahead)

    return Handler


def tiny_gguf_repo(directory: Path, *, seed: int = 0) -> dict[str, Path]:
    """Files of a GGUF repo as the hub serves them: a plain quant, a quant sharded in a folder, an mmproj, a README.

    The plain quant and the mmproj load in llama.cpp; the shards are the two halves of a tiny model (bytes only).
    """
    from lemonkit.testing.tiny_gguf import write_tiny_llama, write_tiny_mmproj

    directory.mkdir(parents=True, exist_ok=True)
    plain = write_tiny_llama(directory / "tiny-Q4_K_M.gguf", seed=seed)
    whole = write_tiny_llama(directory / "whole.gguf", seed=seed + 1).read_bytes()
    (directory / "Q8_0").mkdir(exist_ok=True)
    first = directory / "Q8_0" / "tiny-Q8_0-00001-of-00002.gguf"
    second = directory / "Q8_0" / "tiny-Q8_0-00002-of-00002.gguf"
    first.write_bytes(whole[: len(whole) // 2])
    second.write_bytes(whole[len(whole) // 2 :])
    (directory / "whole.gguf").unlink()
    mmproj = write_tiny_mmproj(directory / "mmproj-tiny-f16.gguf", seed=seed)
    readme = directory / "README.md"
    readme.write_text("# tiny\n")
    return {
        "tiny-Q4_K_M.gguf": plain,
        "Q8_0/tiny-Q8_0-00001-of-00002.gguf": first,
        "Q8_0/tiny-Q8_0-00002-of-00002.gguf": second,
        "mmproj-tiny-f16.gguf": mmproj,
        "README.md": readme,
    }


def _tree_files(directory: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            yield path.relative_to(directory).as_posix(), path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--repo", action="append", default=[], metavar="OWNER/NAME=DIR", help="serve DIR as a repo")
    args = parser.parse_args()
    hub = HubServer(port=args.port)
    for spec in args.repo:
        repo_id, _, directory = spec.partition("=")
        hub.add_repo(repo_id, dict((name, path) for name, path in _tree_files(Path(directory))))
    print(f"hub serving on {hub.url}", flush=True)
    try:
        hub._server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        hub._server.server_close()


if __name__ == "__main__":
    main()

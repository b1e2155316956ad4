"""``lemonkit.map`` against a real server: order, per-item errors, retries of transient failures, pandas inputs,
and an interrupted run that keeps its partial results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pandas as pd
import pytest

import lemonkit
from lemonkit.client import Client
from tests.support.hosts import API_KEY, Standalone
from tests.support.tiny_models import TINY


@pytest.fixture
def client(standalone: Standalone, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    monkeypatch.setenv("LEMONKIT_DEFAULT_CHAT_MODEL", TINY)
    with Client(standalone.root, token=API_KEY) as client:
        yield client
    httpx.post(standalone.root + "api/v1/unload", headers={"Authorization": f"Bearer {API_KEY}"}, json={})


def test_a_template_over_a_list_keeps_input_order(client: Client) -> None:
    words = [f"word{i}" for i in range(6)]
    out = lemonkit.map("Repeat: {}", words, client=client, concurrency=3, max_tokens=3, seed=1, progress=False)
    assert isinstance(out, lemonkit.MapResult) and len(out) == 6 and out.errors == [] and not out.interrupted
    prompts = [r.provenance["request"]["messages"][0]["content"] for r in out]
    assert prompts == [f"Repeat: {w}" for w in words]
    # the same seed and prompt give the same answer whatever the order they ran in
    alone = client.chat("Repeat: word4", stream=False, max_tokens=3, seed=1)
    assert out[4].text == alone.text
    frame = out.to_pandas()
    assert list(frame["output"]) == [r.text for r in out] and frame["error"].isna().all()


def test_failing_items_are_errors_in_their_slots_and_transient_ones_are_retried(client: Client) -> None:
    calls: dict[Any, int] = {}
    lock = threading.Lock()

    def prompt(item: Any) -> Any:
        with lock:
            calls[item] = calls.get(item, 0) + 1
            attempt = calls[item]
        if item == "flaky" and attempt == 1:
            raise lemonkit.ServerUnavailable("dropped")  # transient: tried again
        if item == "broken":
            raise ValueError("cannot make a prompt of this")  # not transient: final at once
        if item == "missing":
            return client.chat("hi", "user.no-such-model", stream=False)  # the server's 404: final too
        if item == "plain":
            return 42  # not a prompt: kept as it is
        if item == "nothing":
            return None  # kept too: a finished item, not a pending one
        return f"Say {item}"

    items = ["a", "flaky", "broken", "plain", "missing", "b", "nothing"]
    out = lemonkit.map(prompt, items, client=client, concurrency=2, retries=2, max_tokens=2, progress=False)
    assert [type(r).__name__ for r in out] == [
        "ChatResult",
        "ChatResult",
        "MapError",
        "int",
        "MapError",
        "ChatResult",
        "NoneType",
    ]
    assert out.pending == [] and not out.interrupted
    broken, missing = out.errors
    assert (broken.index, broken.item, broken.attempts, type(broken.error)) == (2, "broken", 1, ValueError)
    assert (missing.index, missing.attempts, type(missing.error)) == (4, 1, lemonkit.ModelNotFound)
    assert calls["flaky"] == 2 and out[1].provenance["request"]["messages"][0]["content"] == "Say flaky"
    frame = out.to_pandas()
    assert frame.loc[2, "error"] == "ValueError: cannot make a prompt of this" and frame.loc[3, "output"] == 42


def test_a_transient_failure_that_persists_uses_every_retry(client: Client) -> None:
    def down(item: Any) -> str:
        raise lemonkit.ServerUnavailable("still down")

    (failed,) = lemonkit.map(down, ["x"], client=client, retries=1, progress=False).errors
    assert failed.attempts == 2 and isinstance(failed.error, lemonkit.ServerUnavailable)


def test_a_dataframe_fills_named_fields_and_a_series_positional_ones(client: Client) -> None:
    frame = pd.DataFrame({"animal": ["cat", "dog"], "sound": ["meow", "woof"]})
    rows = lemonkit.map("The {animal} says {sound}", frame, client=client, max_tokens=2, progress=False)
    assert [r.provenance["request"]["messages"][0]["content"] for r in rows] == [
        "The cat says meow",
        "The dog says woof",
    ]
    column = lemonkit.map("Name: {}", frame["animal"], client=client, max_tokens=2, progress=False)
    assert [r.provenance["request"]["messages"][0]["content"] for r in column] == ["Name: cat", "Name: dog"]


def test_an_interrupted_run_returns_its_finished_items(standalone: Standalone) -> None:
    script = textwrap.dedent(
        """
        import json, os, signal, lemonkit

        signal.signal(signal.SIGINT, signal.default_int_handler)  # even if our parent ran us with SIGINT ignored

        def prompt(i):
            if i == 3:
                os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C or the kernel's stop button would
            return f"Count {i}"

        out = lemonkit.map(prompt, list(range(12)), concurrency=1, max_tokens=2, progress=True)
        print(json.dumps({
            "interrupted": out.interrupted,
            "done": [i for i, r in enumerate(out) if r is not None],
            "prompts": [r.provenance["request"]["messages"][0]["content"] for r in out if r is not None],
            "pending": out.pending,
        }))
        """
    )
    env = {**os.environ, "LEMONKIT_URL": standalone.root, "LEMONKIT_TOKEN": API_KEY}
    env["LEMONKIT_DEFAULT_CHAT_MODEL"] = TINY
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["interrupted"] is True
    assert summary["done"][:3] == [0, 1, 2] and summary["prompts"][:3] == ["Count 0", "Count 1", "Count 2"]
    assert summary["pending"] and summary["pending"][-1] == 11 and len(summary["done"]) < 12
    assert set(summary["done"]) | set(summary["pending"]) == set(range(12))
    assert "lemonkit.map" in run.stderr  # the progress bar


def test_a_template_runs_as_a_batch_and_a_rerun_computes_only_new_rows(client: Client) -> None:
    client.cache_clear()
    frame = pd.DataFrame({"animal": [f"animal{i}" for i in range(8)]})
    first = lemonkit.map("Describe the {animal}.", frame, client=client, max_tokens=4, progress=False)
    assert len(first) == 8 and first.errors == [] and first.batch_id is not None
    assert first.stats["rows"] == 8 and first.stats["computed"] == 8 and first.stats["cache_hits"] == 0
    assert first.stats["generated_tokens"] == sum(r.usage["completion_tokens"] for r in first)
    assert first.stats["engine_seconds"] > 0 and first.stats["rows_per_second"] > 0
    prompts = [r.provenance["request"]["messages"][0]["content"] for r in first]
    assert prompts == [f"Describe the animal{i}." for i in range(8)]
    # unseeded rows got seeds of their own, the same on every run: the answer a plain chat with that seed gets
    seed = first[3].provenance["seed"]
    assert isinstance(seed, int) and len({r.provenance["seed"] for r in first}) == 8
    assert client.chat("Describe the animal3.", stream=False, max_tokens=4, seed=seed).text == first[3].text

    again = lemonkit.map("Describe the {animal}.", frame, client=client, max_tokens=4, progress=False)
    assert again.batch_id is None and again.stats["cache_hits"] == 8 and again.stats["computed"] == 0
    assert [r.text for r in again] == [r.text for r in first]

    changed = frame.copy()
    changed.loc[5, "animal"] = "zebra"
    third = lemonkit.map("Describe the {animal}.", changed, client=client, max_tokens=4, progress=False)
    assert third.batch_id is not None and third.stats["computed"] == 1 and third.stats["cache_hits"] == 7
    assert third[5].provenance["request"]["messages"][0]["content"] == "Describe the zebra."
    assert [r.text for i, r in enumerate(third) if i != 5] == [r.text for i, r in enumerate(first) if i != 5]


def test_a_schema_gives_typed_rows_and_a_column_per_field(client: Client) -> None:
    from typing import Literal

    import pydantic

    class Label(pydantic.BaseModel):  # fields a tiny random model's grammar-led answer completes in a few tokens
        label: Literal["cat", "dog"]
        flag: bool

    out = lemonkit.map(
        "Label: {}", ["x", "y", "z"], client=client, schema=Label, max_tokens=60, temperature=0, progress=False
    )
    assert out.errors == [] and all(isinstance(r, Label) for r in out)
    typed = list(out)
    frame = out.to_pandas()
    assert list(frame.columns) == ["label", "flag", "error"] and len(frame) == 3
    assert [frame.loc[i, "label"] for i, r in enumerate(out) if isinstance(r, Label)] == [r.label for r in typed]


def test_a_bad_row_is_an_error_in_its_slot(client: Client) -> None:
    out = lemonkit.map("Say {}", ["a", "b"], client=client, max_tokens=2, temperature=-1, progress=False)
    assert len(out.errors) == 2 and {type(e.error) for e in out.errors} == {lemonkit.InvalidArgument}
    assert out.errors[0].index == 0 and out.errors[0].item == "a"

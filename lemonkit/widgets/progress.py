"""A download's progress as the progress bar shows it, built from ``/v1/pull`` events and ``/v1/downloads`` jobs.

State: ``{"status", "percent", "done", "total", "file", "error"}``; ``status`` is a job status (``downloading``,
``paused``, ``cancelled``, ``completed``, ``error``) or ``starting``. ``percent`` is the whole download's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lemonkit.client import Client, Event

__all__ = ["ACTIVE", "STARTING", "control", "follow", "from_event", "from_job", "start"]

STARTING: dict[str, Any] = {"status": "starting", "percent": 0, "done": 0, "total": 0, "file": "", "error": None}
ACTIVE = frozenset({"starting", "downloading"})


def _percent(done: int, total: int, fallback: float = 0) -> float:
    return round(done * 100 / total, 1) if total else fallback


def from_job(job: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/downloads`` job (or the snapshot a ``subscribe=false`` pull answers with)."""
    done, total = job.get("cumulative_bytes_downloaded", 0), job.get("total_download_size", 0)
    error = job.get("error")
    return {
        "status": job["status"],
        "percent": 100 if job.get("complete") else _percent(done, total, job.get("percent", 0)),
        "done": done,
        "total": total,
        "file": _file(job),
        "error": {"message": error, "code": "download_error"} if error else None,
    }


def _file(data: dict[str, Any]) -> str:
    return f"{data['file_index']}/{data['total_files']} {data['file']}" if data.get("file") else ""


def from_event(state: dict[str, Any], event: Event) -> dict[str, Any]:
    """``state`` after one ``/v1/pull`` event."""
    data = event.data if isinstance(event.data, dict) else {}
    if event.name == "progress":
        done, total = data.get("cumulative_bytes_downloaded", state["done"]), data.get("total_download_size") or 0
        return {**state, "status": "downloading", "percent": _percent(done, total), "done": done, "total": total,
                "file": _file(data), "error": None}  # fmt: skip
    if event.name == "complete":
        return {**state, "status": "completed", "percent": 100, "done": state["total"] or state["done"], "error": None}
    if event.name == "error":
        status = data.get("status") or "error"
        error = {"message": data.get("error") or "download failed", "code": data.get("code") or "download_error"}
        return {**state, "status": status, "error": error if status == "error" else None}
    return state


def start(client: Client, name: str) -> dict[str, Any]:
    """Start (or join) the server-owned download of ``name``: it goes on if the kernel goes away, and
    ``/v1/downloads`` lists it for the next model browser."""
    return from_job(client.request("POST", "pull", json={"model_name": name, "stream": True, "subscribe": False}))


def follow(
    client: Client, name: str, state: dict[str, Any], report: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Report the progress of ``name``'s running download until it completes or stops; returns the last state.

    Subscribing joins the running job (a subscriber's pull of a model with a running job never starts another).
    """
    for event in client.events("pull", {"model_name": name, "stream": True}):
        state = from_event(state, event)
        if event.name != "ping":
            report(state)
        if event.name in ("complete", "error"):
            break
    return state


def control(client: Client, name: str, action: str) -> dict[str, Any]:
    """``pause`` or ``cancel`` the download of ``name`` (``/v1/downloads/control``); its new state."""
    return from_job(client.request("POST", "downloads/control", json={"id": f"model:{name}", "action": action}))

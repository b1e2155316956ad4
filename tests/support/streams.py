"""Reading a route's SSE answer in tests: every ``data:`` event as JSON, through real HTTP."""

from __future__ import annotations

import json

import httpx


async def sse_events(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    """POST ``body`` with ``stream: true`` and return each event's JSON (``[DONE]`` and comments left out)."""
    events = []
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events

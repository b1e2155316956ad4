"""``GET`` and ``DELETE /v1/cache``: the caller's answer cache (:mod:`lemonkit.serving.answer_cache`), what it holds and
emptying it. On a shared server each user sees and clears only their own."""

from __future__ import annotations

import asyncio

from lemonkit.server.handler import LemonkitHandler

__all__ = ["AnswerCacheHandler"]


class AnswerCacheHandler(LemonkitHandler):
    async def get(self) -> None:
        self.write_json(await asyncio.to_thread(self.service.answers.info, self.caller.name))

    async def delete(self) -> None:
        removed = await asyncio.to_thread(self.service.answers.clear, self.caller.name)
        self.write_json({"object": "answer_cache", "deleted": removed})

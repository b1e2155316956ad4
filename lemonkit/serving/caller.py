"""Who sent a request, as the host identified them.

A personal server (``lemonkit serve``, the Jupyter extension) has one user, its owner, who may do anything. A
shared server (the JupyterHub service) has many: each request carries its hub user, and what one user may see or
change is limited by :attr:`Caller.admin` and the per-user isolation the service applies when
:attr:`Caller.shared` is set.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass, field

from lemonkit.serving.log_store import StoreHandler

__all__ = ["OWNER", "Caller", "CallerTag", "current", "tag_callers"]


@dataclass(frozen=True)
class Caller:
    """The identity behind one request.

    Args:
        name: The user's name (a hub user's name; ``"owner"`` on a personal server).
        admin: Whether they may change what every user shares (pull, delete, install, load with options...).
        scopes: Their hub scopes (empty on a personal server).
        shared: Whether the server is shared between users, so that one user's requests, logs, jobs and uploads
            are kept from the others.
    """

    name: str
    admin: bool = True
    scopes: frozenset[str] = field(default_factory=frozenset)
    shared: bool = False

    @property
    def own_only(self) -> str | None:
        """Their name when they may see only their own requests, logs and jobs (a shared server's user who is
        not an admin); ``None`` when they see everything."""
        return self.name if self.shared and not self.admin else None


#: the one user of a personal server
OWNER = Caller("owner")

#: the caller of the request being served (log records and jobs are tagged with it)
current: ContextVar[Caller] = ContextVar("lemonkit_caller", default=OWNER)


class CallerTag(logging.Filter):
    """Tags each record with the shared server's user whose request it was logged for (``lemonkit_user``, which
    the log store keeps so that ``/logs/stream`` shows such a user only their own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        who = current.get()
        record.lemonkit_user = who.name if who.shared else None
        return True


def tag_callers(logger_name: str = "lemonkit") -> None:
    """Put :class:`CallerTag` (once) on the log store's handlers of ``logger_name``."""
    for handler in logging.getLogger(logger_name).handlers:
        if isinstance(handler, StoreHandler) and not any(isinstance(f, CallerTag) for f in handler.filters):
            handler.addFilter(CallerTag())

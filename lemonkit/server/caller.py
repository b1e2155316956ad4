"""Who sent a request, as the host identified them.

A personal server (``lemonkit serve``, the Jupyter extension) has one user, its owner, who may do anything. A
shared server (the JupyterHub service) has many: each request carries its hub user, and what one user may see or
change is limited by :attr:`Caller.admin` and the per-user isolation the service applies when
:attr:`Caller.shared` is set.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = ["OWNER", "Caller", "current"]


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


#: the one user of a personal server
OWNER = Caller("owner")

#: the caller of the request being served (log records and jobs are tagged with it)
current: ContextVar[Caller] = ContextVar("lemonkit_caller", default=OWNER)

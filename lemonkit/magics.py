"""IPython magics: ``%load_ext lemonkit`` adds ``%%chat`` and ``%lemonkit``.

``%%chat [--model M] [--system S]`` asks the cell's body and streams the answer; the cell's value (``Out``, ``_``)
is the :class:`~lemonkit.client.results.ChatResult`. ``%lemonkit status|models|load M|unload [M]`` manages the server.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from lemonkit import api
from lemonkit.client.results import ChatResult
from lemonkit.commands import status_lines

__all__ = ["LemonkitMagics", "load_ipython_extension"]

_USAGE = "usage: %lemonkit status | models [--all] | load MODEL | unload [MODEL]"


@magics_class
class LemonkitMagics(Magics):
    @magic_arguments()
    @argument("--model", "-m", default=None, help="the model (default: the loaded LLM, else the embedded default)")
    @argument("--system", "-s", default=None, help="a system message")
    @argument("--max-tokens", type=int, default=None, help="the answer's length limit")
    @cell_magic
    def chat(self, line: str, cell: str) -> ChatResult:
        """Ask the cell's body; the answer streams below and the cell's value is the ChatResult."""
        args = self.chat.parser.parse_args(shlex.split(line))  # IPython's own split keeps the quotes
        sampling = {"max_tokens": args.max_tokens} if args.max_tokens is not None else {}
        return api.chat(cell.strip(), args.model, system=args.system, **sampling)

    @line_magic
    def lemonkit(self, line: str) -> Any:
        """``%lemonkit status|models [--all]|load MODEL|unload [MODEL]``."""
        words = shlex.split(line)
        command, rest = (words[0], words[1:]) if words else ("status", [])
        if command == "status":
            print("\n".join(status_lines(api.default_client())))
            return None
        if command == "models":
            return api.models(all="--all" in rest)
        if command == "load" and len(rest) == 1:
            return _message(api.load(rest[0]))
        if command == "unload" and len(rest) <= 1:
            return _message(api.unload(rest[0] if rest else None))
        print(_USAGE)
        return None


def _message(answer: dict[str, Any]) -> None:
    print(answer.get("message") or json.dumps(answer))


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(LemonkitMagics)

"""The widgets' front-end code, shipped in ``static/`` (no CDN: notebooks are often offline).

anywidget loads each widget's ESM as one module, so a panel's ``import {...} from "./shared.js"`` line is replaced
by ``shared.js`` itself: the building blocks live in one file and every panel gets the same ones.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

__all__ = ["STATIC", "css", "esm"]

STATIC = Path(__file__).parent / "static"
_SHARED_IMPORT = re.compile(r'^import \{[^}]*\} from "\./shared\.js";\n', re.M)


@cache
def esm(panel: str) -> str:
    """``static/<panel>.js`` as one self-contained module."""
    shared = (STATIC / "shared.js").read_text(encoding="utf-8")
    return _SHARED_IMPORT.sub(lambda _: shared, (STATIC / f"{panel}.js").read_text(encoding="utf-8"), count=1)


@cache
def css() -> str:
    return (STATIC / "widgets.css").read_text(encoding="utf-8")

"""The test session's environment, fixed before lemonkit or huggingface_hub is imported: every host of the session
(the in-process Jupyter server and the standalone subprocess) sees the same HF cache and lemonkit cache dir, offline.

``tests/conftest.py`` imports this module before anything else; importing it sets the environment once per process.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["CACHE_DIR", "HF_CACHE", "ROOT"]

#: the session's scratch root (removed when the session ends)
ROOT = Path(tempfile.mkdtemp(prefix="lemonkit-tests-"))
#: the session's Hugging Face cache
HF_CACHE = ROOT / "hub"
#: the session's lemonkit cache dir (``LEMONADE_CACHE_DIR``)
CACHE_DIR = ROOT / "cache"
os.environ["HF_HUB_CACHE"] = str(HF_CACHE)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["LEMONADE_CACHE_DIR"] = str(CACHE_DIR)
os.environ["JUPYTER_RUNTIME_DIR"] = str(ROOT / "runtime")  # server records: the session's servers only
os.environ.pop("LEMONADE_API_KEY", None)

"""Layers import only downward: a module may import its own layer and the layers below it, never one above.

From the bottom: formats (wire shapes, files, parsers: no model, no state) -> models (what a model is and where
its files are) -> engines (the sidecars' backends, downloads, recipes) -> serving (the model manager and what it
runs on) -> the server and the Python client, side by side and never importing each other -> the notebook layer
(``api``, widgets, magics, the CLI). The README's architecture section draws the same picture.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lemonkit

PACKAGE = Path(lemonkit.__file__).parent

FORMATS, MODELS, ENGINES, SERVING, SIDES, NOTEBOOK = range(6)
LAYERS: dict[str, int] = {
    **dict.fromkeys(
        (
            "_version",
            "errors",
            "sse",
            "files",
            "bodies",
            "caller",
            "logs",
            "metrics",
            "health",
            "gguf_header",
            "llamacpp_args",
            "llamacpp_builds",
            "accelerators",
            "schemas",
            "audio",
            "vad",
            "subtitles",
            "diffusers_layout",
            "whisper_parts",
        ),
        FORMATS,
    ),
    **dict.fromkeys(
        (
            "model_info",
            "hf_cache",
            "registry",
            "bundled",
            "kokoro_bundle",
            "minilm_bundle",
            "catalog",
            "options",
            "system_info",
            "placement",
            "config",
            "omni",
        ),
        MODELS,
    ),
    **dict.fromkeys(("backends", "downloads", "recipes"), ENGINES),
    **dict.fromkeys(
        ("manager", "fairness", "installer", "response_store", "server_records", "voice_pipeline", "hub_discovery"),
        SERVING,
    ),
    "server": SIDES,
    **dict.fromkeys(
        (
            "client",
            "api_requests",
            "chat_methods",
            "audio_methods",
            "image_methods",
            "results",
            "display",
            "speech",
            "images",
            "transcripts",
            "voice_chat_reply",
            "plots",
            "provenance",
            "conversation",
            "map_items",
        ),
        SIDES,
    ),
    **dict.fromkeys(("api", "widgets", "magics", "commands", "cli", "__main__", "__init__", "testing"), NOTEBOOK),
}
#: the server and the Python client share a layer and must not import each other
CLIENT = {name for name, rank in LAYERS.items() if rank == SIDES and name != "server"}
#: the one upward import, by design: a model list shown in a notebook is the model browser widget, imported when
#: Jupyter asks for its display (never on import; without anywidget it is a static table)
DISPLAY_HOOKS = {("results.py", "widgets")}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    """The lemonkit modules ``path`` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "lemonkit":
                found |= {f"lemonkit.{a.name}" for a in node.names}
            elif node.module.startswith("lemonkit."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lemonkit.")}
    return found


def test_every_module_has_a_layer() -> None:
    tops = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.rglob("*.py")}
    assert tops - {"data"} <= set(LAYERS), sorted(tops - set(LAYERS))


def test_layers_import_only_downward() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        source = (
            relative.parts[0].removesuffix(".py")
            if len(relative.parts) > 1 or relative.name != "__init__.py"
            else "__init__"
        )
        for target in sorted(_top(m) for m in _imports(path)):
            if target not in LAYERS or target == source or (str(relative), target) in DISPLAY_HOOKS:
                continue
            wrong = LAYERS[target] > LAYERS[source]
            wrong |= (source == "server" and target in CLIENT) or (source in CLIENT and target == "server")
            if wrong:
                upward.append(f"{relative} imports lemonkit.{target}")
    assert not upward, "\n".join(upward)

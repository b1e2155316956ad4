"""``import lemonkit`` is cheap: public names resolve on first use, and a sidecar loads only what it runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import lemonkit

#: layers a model's sidecar process never needs: the notebook client and its results, widgets, the HTTP server
CLIENT_SIDE = ("lemonkit.api", "lemonkit.client", "lemonkit.client.results", "lemonkit.widgets", "lemonkit.server")


def _modules_after(code: str) -> list[str]:
    program = f"import json, sys\n{code}\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('lemonkit'))))"
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    return list(json.loads(out.strip().splitlines()[-1]))


def test_import_lemonkit_loads_nothing_but_its_version() -> None:
    assert _modules_after("import lemonkit") == ["lemonkit", "lemonkit._version"]
    heavy = "import lemonkit\nprint([m for m in ('httpx', 'numpy', 'anywidget', 'tornado') if m in sys.modules])"
    assert (
        subprocess.run([sys.executable, "-c", "import sys\n" + heavy], capture_output=True, text=True).stdout == "[]\n"
    )


def test_a_sidecar_imports_no_client_widget_or_server_module() -> None:
    loaded = _modules_after("import lemonkit.backends.sidecar")
    assert "lemonkit.backends.sidecar" in loaded
    assert not [m for m in loaded if m.startswith(CLIENT_SIDE)], loaded


def test_public_names_resolve_on_first_use() -> None:
    from lemonkit import api, errors

    assert lemonkit.chat is api.chat and lemonkit.LemonkitError is errors.LemonkitError
    assert lemonkit.map.__name__ == "map_items"
    for name in lemonkit.__all__:
        assert getattr(lemonkit, name) is not None, name
    assert {"chat", "Client", "ModelBrowser"} <= set(dir(lemonkit))
    assert lemonkit.__version__ == lemonkit._version.__version__
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = lemonkit.no_such_name
    # a submodule as an attribute, imported on first use (notebooks write lemonkit.catalog.config.default_chat_model())
    assert lemonkit.catalog.config.default_chat_model()
    assert _modules_after("import lemonkit; lemonkit.errors").count("lemonkit.errors") == 1


def test_every_widget_name_resolves() -> None:
    """The widgets resolve on first use too, each from the module its table names."""
    import lemonkit.widgets

    for name in lemonkit.widgets.__all__:
        assert getattr(lemonkit, name) is getattr(lemonkit.widgets, name)
        assert isinstance(getattr(lemonkit.widgets, name), type), name

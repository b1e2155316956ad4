"""An action from the page carries the fields it depends on (ipywidgets may still hold their update back): the
panel applies the fields it lists in ``page_fields`` before the action runs, and nothing else."""

from __future__ import annotations

from typing import Any, ClassVar

import traitlets

from lemonkit.widgets.panel import Panel


class Recorder(Panel):
    actions: ClassVar[frozenset[str]] = frozenset({"run"})
    page_fields: ClassVar[frozenset[str]] = frozenset({"seed"})
    seed = traitlets.Int(-1).tag(sync=True)
    locked = traitlets.Unicode("kept").tag(sync=True)

    def run(self, *args: Any) -> None:
        self.seen = (self.seed, self.locked, args)


def test_page_fields_are_applied_before_the_action() -> None:
    panel = Recorder()
    panel._on_message(panel, {"action": "run", "args": ["x"], "state": {"seed": 5, "locked": "changed"}}, [])
    assert panel.seen == (5, "kept", ("x",))


def test_an_action_without_state_uses_the_traits() -> None:
    panel = Recorder(seed=3)
    panel._on_message(panel, {"action": "run", "args": []}, [])
    assert panel.seen == (3, "kept", ())


def test_a_bad_field_value_is_an_error_in_the_banner_not_an_exception() -> None:
    panel = Recorder()
    panel._on_message(panel, {"action": "run", "args": [], "state": {"seed": "five"}}, [])
    assert panel.error is not None and not hasattr(panel, "seen")

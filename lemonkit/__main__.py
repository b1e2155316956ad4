"""``python -m lemonkit``: the ``lemonkit`` command (what a JupyterHub service or a script runs with a chosen
interpreter)."""

from lemonkit.cli import main

main()

"""``python -m lemonkit``: the ``lemonkit`` command (what a JupyterHub service or a script runs with a chosen
interpreter)."""

from lemonkit.cli import main

if __name__ == "__main__":  # importing every submodule (tests do) must not run the command
    main()

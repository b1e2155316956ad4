"""Tests of the notebook layer (lemonkit.api, magics, commands, the CLI) and of the notebooks themselves."""

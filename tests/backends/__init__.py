"""Tests of lemonkit.backends: the engines called directly, and the sidecar process."""

"""Tests of lemonkit.testing: the tiny generated models."""

"""Tests of lemonkit.formats: wire shapes, files and parsers."""

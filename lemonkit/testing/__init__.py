"""Helpers for tests: tiny random-weight models written in code, so every engine path runs offline in milliseconds."""

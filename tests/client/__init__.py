"""Tests of lemonkit.client: the Python clients and their results, alone and against real servers."""

"""Tests of lemonkit.widgets: the panels driven from Python against real servers, and in a real browser."""

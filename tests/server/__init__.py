"""Tests of lemonkit.server: its pieces on their own, and every route through real HTTP on both hosts."""

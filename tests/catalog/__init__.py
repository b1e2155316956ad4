"""Tests of lemonkit.catalog: the registry, recipes, options, the machine and the bundled models."""

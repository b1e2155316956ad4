"""Omni collections (``recipe: "collection.omni"``): the server-side tool loop's pure parts.

- :mod:`~lemonkit.omni.tools`: which component plays which role, the built-in tools and system prompt;
- :mod:`~lemonkit.omni.media`: media embedded in an assistant's ``content`` (made, found, stripped, chunked).

The loop itself, which talks to the components' sidecars, is :mod:`lemonkit.server.omni`.
"""

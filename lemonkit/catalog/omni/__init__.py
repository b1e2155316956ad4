"""Omni collections (``recipe: "collection.omni"``): the server-side tool loop's pure parts.

- :mod:`~lemonkit.catalog.omni.builtin_tools`: which component plays which role, the built-in tools and system prompt;
- :mod:`~lemonkit.catalog.omni.media`: media embedded in an assistant's ``content`` (made, found, stripped, chunked).

The loop itself, which talks to the components' sidecars, is :mod:`lemonkit.server.omni_loop`.
"""

"""The HTTP layer: one set of Tornado handlers, served by two hosts.

- :mod:`lemonkit.server.extension`: the jupyter-server extension (``{base_url}lemonkit/``, Jupyter auth).
- :mod:`lemonkit.server.standalone`: ``lemonkit serve`` (port 13305, ``LEMONADE_API_KEY``).
- :mod:`lemonkit.server.routes`: which handler serves which route; :mod:`.openai` and :mod:`.lemonade` hold them.
"""

"""What the tests share besides fixtures: the session's environment, the tiny models, the hosts, local hubs and
upstreams, real Jupyter and JupyterHub processes, speech, pictures and waiting. Import them as
``from tests.support.<module> import ...``; the fixtures built on them are in ``tests/conftest.py``.

Nothing here is imported by this ``__init__``: a subprocess that imports one helper (the sidecar test's fault
engine) loads only that one."""

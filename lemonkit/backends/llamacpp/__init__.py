"""The ``llamacpp`` recipe: chat, completions, embeddings and rerank on llama-cpp-python.

One :class:`LlamaCppEngine` owns one ``llama_cpp.Llama`` and runs in a sidecar process (see
:mod:`lemonkit.backends.base`); requests arrive one at a time on the sidecar's worker thread.

- :mod:`~lemonkit.backends.llamacpp.engine`: loading, the OpenAI routes, chat requests to prompts;
- :mod:`~lemonkit.backends.llamacpp.generation`: prompt evaluation, sampling (with grammars), stop strings, logprobs;
- :mod:`~lemonkit.backends.llamacpp.vision`: the mmproj and prompts with images;
- :mod:`~lemonkit.backends.llamacpp.shapes`: OpenAI answers and chunks built from generated tokens.

Flag strings (``llamacpp_args``) are parsed by :mod:`lemonkit.llamacpp_args`; prompts are rendered and outputs
parsed by :mod:`lemonkit.backends.chat`. Nothing here imports llama_cpp until an engine is created.
"""

from lemonkit.backends.llamacpp.engine import LlamaCppEngine

__all__ = ["LlamaCppEngine"]

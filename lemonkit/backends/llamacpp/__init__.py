"""The ``llamacpp`` recipe: chat, completions, embeddings and rerank on llama-cpp-python.

One :class:`LlamaCppEngine` owns one ``llama_cpp.Llama`` and runs in a sidecar process (see
:mod:`lemonkit.backends.protocol`); up to ``--parallel`` requests arrive at once, each on a sidecar worker thread, and
one decode thread generates them together.

- :mod:`~lemonkit.backends.llamacpp.engine`: loading, the OpenAI routes, chat requests to prompts;
- :mod:`~lemonkit.backends.llamacpp.generation`: sampling settings, tokens to text, stop strings;
- :mod:`~lemonkit.backends.llamacpp.batch`: the decode thread, its slots, chunked prefill and per-slot prompt caches;
- :mod:`~lemonkit.backends.llamacpp.sampler`: one sequence's sampler (grammar last) and logprobs;
- :mod:`~lemonkit.backends.llamacpp.vision`: the mmproj and prompts with images;
- :mod:`~lemonkit.backends.llamacpp.answers`: OpenAI answers and chunks built from generated tokens.

Flag strings (``llamacpp_args``) are parsed by :mod:`lemonkit.formats.llamacpp_args`; prompts are rendered and outputs
parsed by :mod:`lemonkit.backends.chat`. Nothing here imports llama_cpp until an engine is created.
"""

from lemonkit.backends.llamacpp.engine import LlamaCppEngine

__all__ = ["LlamaCppEngine"]

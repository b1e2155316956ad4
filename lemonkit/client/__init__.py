"""The Python client: how Python code reaches a lemonkit server, beside ``lemonkit.server`` and never importing it.

:class:`Client` and :class:`AsyncClient` (``_client``) find a server (``discovery``) and run the calls, each
written once as steps both clients drive (``chat_calls``, ``audio_calls``, ``image_calls``, ``model_calls``);
what they return is in ``results``, ``transcripts``, ``audio_clips``, ``image_results`` and
``voice_chat_reply``, shown by ``display`` and ``plots``, rerun by ``replay``.
"""

from lemonkit.client._client import AsyncClient, Client, Event, Server, ServerUnavailable, default_client, locate

__all__ = ["AsyncClient", "Client", "Event", "Server", "ServerUnavailable", "default_client", "locate"]

"""The bottom layer: wire shapes, parsers and file writing, with no model and no server state.

SSE framing (``sse``), strict request bodies (``bodies``), their schemas (``schemas``) and the nodes those are
built of (``schema_nodes``), atomic files (``files``), audio decoding and encoding (``audio_codec``), voice
activity (``vad``), subtitles, a GGUF header reader, llama-server style flag strings (``llamacpp_args``), the
``/v1/health`` answer (``health``) and an engine's cumulative figures (``generation_metrics``). Everything above
may import these; they import nothing of lemonkit but ``errors``.
"""

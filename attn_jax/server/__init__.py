"""``attn-stack serve``: the engine behind an OpenAI-compatible HTTP API (the ``serve`` extra).

``app.py`` the FastAPI app (routes, errors, server-sent events); ``protocol.py`` the
request and response bodies; ``engine_loop.py`` the engine in its own thread;
``stop_strings.py`` stop sequences on streamed text; ``metrics.py`` Prometheus metrics;
``engine_probe.py`` the engine counts the metrics read; ``model_source.py`` which engine
``--model`` names.
"""

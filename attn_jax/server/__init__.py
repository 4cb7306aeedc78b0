"""``attn-stack serve``: the engine behind an OpenAI-compatible HTTP API (the ``serve`` extra).

``app.py`` the FastAPI app (routes, errors, server-sent events); ``protocol.py`` the
request and response bodies; ``engine_core.py`` the engine's side (commands in, one
message per round out); ``engine_process.py`` that core in a process of its own (what
``attn-stack serve`` runs); ``engine_loop.py`` the event loop's side (requests' deltas);
``stop_strings.py`` stop sequences on streamed text; ``metrics.py`` Prometheus metrics;
``engine_probe.py`` the engine counts the metrics read; ``model_source.py`` which engine
``--model`` names; ``gc_heap.py`` each server process's startup heap frozen out of the
garbage collector.
"""

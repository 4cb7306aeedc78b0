"""The GPU a benchmark runs on, or a clear refusal where there is none."""

from __future__ import annotations

import sys


def gpu_device():
    """jax's first device when it is a GPU; otherwise prints why the benchmark cannot run
    (to stderr) and returns None."""
    import jax

    dev = jax.devices()[0]
    if dev.platform != "gpu":
        print(f"this benchmark needs a GPU; jax sees {dev.platform}", file=sys.stderr)
        return None
    return dev

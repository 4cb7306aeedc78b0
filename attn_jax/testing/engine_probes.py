"""Looking inside a serving engine's step, for tests and benchmarks.

Example::

    jit_step, args = record_step_call(engine, lambda: engine.generate(prompts, params))
    hlo = jit_step.lower(*args).compile().as_text()      # the step the engine ran last
"""

from __future__ import annotations

from collections.abc import Callable


def record_step_call(engine, run: Callable[[], object]) -> tuple[Callable, tuple]:
    """Runs ``run()`` with ``engine``'s jitted step watched; returns the jitted step and
    the arguments of its last call (weights, caches, last tokens, packed inputs, layout,
    candidate count), to lower, compile or call again."""
    calls = []
    target = engine.runner  # the engine's model runner holds the jitted step
    jit_step = target._jit_step

    def recording(*args):
        calls.append(args)
        return jit_step(*args)

    target._jit_step = recording
    try:
        run()
    finally:
        target._jit_step = jit_step
    if not calls:
        raise ValueError("run() made the engine run no step")
    return jit_step, calls[-1]

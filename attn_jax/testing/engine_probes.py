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
    target = engine.runner  # the engine's model runner holds the jitted steps (one per compiler options)
    jit_steps = {name: getattr(target, name) for name in ("_jit_step", "_jit_step_wide")}

    def recording(jit_step):
        def record(*args):
            calls.append((jit_step, args))
            return jit_step(*args)

        return record

    for name, jit_step in jit_steps.items():
        setattr(target, name, recording(jit_step))
    try:
        run()
    finally:
        for name, jit_step in jit_steps.items():
            setattr(target, name, jit_step)
    if not calls:
        raise ValueError("run() made the engine run no step")
    return calls[-1]

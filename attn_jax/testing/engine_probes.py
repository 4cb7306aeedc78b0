"""Looking inside a serving engine's step, for tests and benchmarks.

Example::

    jit_step, args = record_step_call(engine, lambda: engine.generate(prompts, params))
    hlo = jit_step.lower(*args).compile().as_text()      # the step the engine ran last
    with count_backend_compiles() as compiles:
        engine.generate(prompts, params)
    assert compiles == []                                 # every program was warmed
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


@contextlib.contextmanager
def count_backend_compiles() -> Iterator[list[float]]:
    """Collects the duration (s) of every XLA compilation inside (jitted or eager, any
    function, any thread) into the list it yields."""
    events: list[float] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


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

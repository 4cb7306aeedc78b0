"""``gc_heap.freeze_startup_heap``: the startup heap leaves the collector's walks, young
collections come rarer; run in a subprocess (freezing pytest's own heap would outlive the test)."""

import subprocess
import sys

import pytest

from attn_jax.server.gc_heap import GEN0_THRESHOLD, freeze_startup_heap


def test_freezes_the_heap_and_raises_the_young_threshold():
    code = (
        "import gc; from attn_jax.server.gc_heap import freeze_startup_heap\n"
        "keep = [[i] for i in range(1000)]; old = gc.get_threshold()\n"
        "freeze_startup_heap()\n"
        "print(gc.get_freeze_count() >= 1000, gc.get_count()[0] < 100,\n"
        f"      gc.get_threshold() == ({GEN0_THRESHOLD}, *old[1:]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr


def test_a_threshold_below_one_is_refused():
    with pytest.raises(ValueError, match="gen0_threshold=0 must be >= 1"):
        freeze_startup_heap(0)

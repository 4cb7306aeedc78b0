"""The launch sweep (benchmarks/gpu_launch_sweep.py): its coverage here, its runs on a GPU.

On a GPU (marker ``gpu``) the pairwise cover of dtype x head size x group x page x batch
mode x feature runs through the public layer, with host-built and traced metadata, and
every accepted configuration must launch and match the float64 oracle; the full sweep
(700 configurations) is the benchmark script's, with its table in BENCHMARKS.md.
"""

from __future__ import annotations

import itertools

import jax
import pytest

from benchmarks.gpu_launch_sweep import DIMS, pairwise_cover, run_config, sweep_configs

needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")


def test_the_cover_holds_every_pair_and_the_full_products():
    rows = pairwise_cover()
    for (i, di), (j, dj) in itertools.combinations(enumerate(DIMS), 2):
        seen = {(r[i], r[j]) for r in rows}
        missing = set(itertools.product(di, dj)) - seen
        assert not missing, f"dimensions {i} and {j}: pairs never run: {sorted(missing)[:5]}"
    names = {c.name for c in sweep_configs()}
    assert "float32-h256-g16-p128-mixed-none" in names and "fp8-h128-g8-p64-decode-none" in names
    assert len(names) < 800, "the sweep must stay within one device call"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("row", pairwise_cover(), ids=lambda r: "-".join(map(str, r)))
def test_every_accepted_configuration_launches_and_matches_the_oracle(row):
    from benchmarks.gpu_launch_sweep import SweepConfig

    for result in run_config(SweepConfig(*row)):
        assert result["status"] in ("ok", "rejected"), result.get("traceback", result)

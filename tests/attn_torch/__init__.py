"""Tests of attn_torch.

``import bridge`` here, in the first test package pytest collects, so its JAX policies
(``bridge._jax_memory``: no GPU preallocation; JAX CPU computations on the calling
thread) are in place before any test initialises JAX in this process. Without the CPU
thread policy, XLA's spinning thread pool starves torch on this 2-core machine and the
transformers tests run several times slower. This applies to every test in the worker.
"""

import bridge  # noqa: F401

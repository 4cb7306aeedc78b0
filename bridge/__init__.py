"""attn-stack's bridge between PyTorch and JAX.

``bridge.dlpack``: ``to_jax`` / ``to_torch``, zero-copy tensor exchange with explicit
errors. ``bridge.xla``: PyTorch on TPU through torchax. Importing this package first sets
JAX's GPU memory policy (no preallocation) and its CPU thread policy (computations on the
calling thread) before JAX initialises (``bridge._jax_memory``), so JAX neither takes the
GPU nor the CPU cores that PyTorch shares.
"""

from bridge._jax_memory import configure_jax_cpu_threads, configure_jax_memory

JAX_MEMORY_POLICY = configure_jax_memory()
"""What ``configure_jax_memory`` did at import: "set", "user" or "too-late"."""
JAX_CPU_THREAD_POLICY = configure_jax_cpu_threads()
"""What ``configure_jax_cpu_threads`` did at import: "set", "user" or "too-late"."""

"""attn-stack's bridge between PyTorch and JAX.

``bridge.dlpack``: ``to_jax`` / ``to_torch``, zero-copy tensor exchange with explicit
errors. The torch side's ground floor: it imports nothing of attn_torch (PyTorch on TPU
through torchax is ``attn_torch.torchax``). Importing this package first sets
JAX's GPU memory policy (``bridge._jax_memory``) so JAX does not preallocate the GPU that
PyTorch shares.
"""

from bridge._jax_memory import configure_jax_memory

JAX_MEMORY_POLICY = configure_jax_memory()
"""What ``configure_jax_memory`` did at import: "set", "user" or "too-late"."""

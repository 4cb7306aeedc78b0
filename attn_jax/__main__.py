"""``python -m attn_jax``: the ``attn-stack`` command line."""

import sys

from attn_jax.cli import main

sys.exit(main())

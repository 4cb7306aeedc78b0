"""The ``attn-stack`` command line: ``info`` (later ``generate`` and ``bench``).

``attn-stack info`` prints the JAX versions, the platform and why each attention
backend would or would not serve a request (default: head_size 128, bfloat16).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from attn_jax.types import ACTIVATION_DTYPES, CACHE_DTYPES, AttentionType


def _add_selection_args(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``get_attn_backend``, shared by every subcommand that selects one."""
    parser.add_argument("--head-size", type=int, default=128, help="per-head dimension D (default: 128)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=[str(d) for d in ACTIVATION_DTYPES],
        help="activation dtype (default: bfloat16)",
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=CACHE_DTYPES, help="KV cache dtype (default: auto)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache page (default: 16)")
    parser.add_argument(
        "--attn-type",
        default=AttentionType.DECODER.value,
        choices=[t.value for t in AttentionType],
        help="attention type (default: decoder)",
    )
    parser.add_argument("--has-sink", action="store_true", help="the layer has attention sinks")


def _cmd_info(args: argparse.Namespace) -> int:
    """Prints the JAX versions, the platform and the backend selection report."""
    import jax
    import jaxlib

    from attn_jax.platforms import current_platform
    from attn_jax.selector import explain_attn_backend_selection

    platform = current_platform()
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}")
    print(
        f"platform: {platform.kind}, device kind {platform.device_kind!r}, "
        f"{platform.num_devices} device(s)"
    )
    print()
    try:
        report = explain_attn_backend_selection(
            args.head_size,
            args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size,
            has_sink=args.has_sink,
            attn_type=args.attn_type,
            platform=platform,
        )
    except ValueError as e:
        return _error(args, e)
    print(report.format())
    if report.chosen is None:
        return _error(args, "no attention backend can serve this configuration (reasons above)")
    return 0


def _error(args: argparse.Namespace, message: object) -> int:
    """Prints a one-line error to stderr; returns exit code 2."""
    print(f"attn-stack {args.command}: error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    """The ``attn-stack`` parser; each subcommand sets ``func(args) -> exit code``."""
    parser = argparse.ArgumentParser(prog="attn-stack", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = commands.add_parser(
        "info", help="versions, platform and attention backend selection", description=_cmd_info.__doc__
    )
    _add_selection_args(info)
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``attn-stack``; returns the exit code (2 for a usage or selection error).

    Example: ``main(["info", "--head-size", "64", "--kv-cache-dtype", "fp8"])``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)

"""Attention backend selection: forced backend > ``ATTN_STACK_BACKEND`` > platform priority.

Mirrors vLLM's ``vllm.attention.selector``, with two deliberate differences: the
environment variable is read at call time (never inside a cache), and selection
explains itself (``explain_attn_backend_selection``; every error lists each
backend's reasons). The cache is keyed on every input, the forced backend, the env
value, the registry overrides and the platform included, so it is never stale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Iterator
from typing import Literal

from attn_jax.backends.base import AttentionBackend, AttentionConfig
from attn_jax.platforms import Platform, current_platform
from attn_jax.registry import AttentionBackendEnum, overrides_snapshot
from attn_jax.types import AttentionType, validate_activation_dtype, validate_cache_dtype, validate_positive_int

logger = logging.getLogger(__name__)

ENV_VAR = "ATTN_STACK_BACKEND"
"""Names an AttentionBackendEnum member to use when no backend is forced; "" = unset."""

PLATFORM_PRIORITY: dict[str, tuple[AttentionBackendEnum, ...]] = {
    "tpu": (
        AttentionBackendEnum.PALLAS_TPU, AttentionBackendEnum.XLA,
        AttentionBackendEnum.PALLAS_MLA_TPU, AttentionBackendEnum.XLA_MLA,
    ),
    "gpu": (
        AttentionBackendEnum.PALLAS_GPU, AttentionBackendEnum.XLA,
        AttentionBackendEnum.PALLAS_MLA_GPU, AttentionBackendEnum.XLA_MLA,
    ),
    "cpu": (AttentionBackendEnum.XLA, AttentionBackendEnum.XLA_MLA),
}  # fmt: skip
"""Backends tried in order when nothing is forced or named in the environment. The MLA
backends serve only ``use_mla=True`` layers and the others never do, so the two families
do not compete."""

SelectionHow = Literal["forced", "env", "priority"]

_forced_attn_backend: AttentionBackendEnum | None = None


def global_force_attn_backend(attn_backend: AttentionBackendEnum | None) -> None:
    """Forces every selection to ``attn_backend``; None re-enables automatic selection.

    A forced backend takes precedence over ``ATTN_STACK_BACKEND``.
    """
    if attn_backend is not None and not isinstance(attn_backend, AttentionBackendEnum):
        raise TypeError(
            f"attn_backend={attn_backend!r} must be None or an AttentionBackendEnum member "
            f"(use AttentionBackendEnum[name]). "
            f"Valid options are: {', '.join(AttentionBackendEnum.__members__)}"
        )
    global _forced_attn_backend
    _forced_attn_backend = attn_backend


def get_global_forced_attn_backend() -> AttentionBackendEnum | None:
    """The forced backend, or None while selection is automatic."""
    return _forced_attn_backend


@contextlib.contextmanager
def global_force_attn_backend_context_manager(attn_backend: AttentionBackendEnum | None) -> Iterator[None]:
    """Forces ``attn_backend`` inside the block; restores the prior value and clears caches on exit."""
    original = get_global_forced_attn_backend()
    global_force_attn_backend(attn_backend)
    try:
        yield
    finally:
        global_force_attn_backend(original)
        _cached_get_attn_backend.cache_clear()


@dataclasses.dataclass(frozen=True)
class BackendRow:
    """One backend's line in a ``SelectionReport``."""

    name: str
    """The AttentionBackendEnum member's name, e.g. "XLA"."""
    class_path: str | None
    """The class path (respecting overrides); None for an unregistered CUSTOM."""
    usable: bool
    """Whether it could serve the request: it imports, validates, and may be chosen here."""
    reasons: list[str]
    """Why it is not usable; empty when it is."""


@dataclasses.dataclass(frozen=True)
class SelectionReport:
    """Why ``get_attn_backend`` would choose what it chooses, for every backend.

    ``rows`` has one row per AttentionBackendEnum member, in enum order; CUSTOM only if
    registered or requested. ``requested`` is the forced or env-named backend.
    """

    request: AttentionConfig
    platform: Platform
    how: SelectionHow
    requested: AttentionBackendEnum | None
    chosen: AttentionBackendEnum | None
    rows: list[BackendRow]

    @property
    def priority(self) -> tuple[AttentionBackendEnum, ...]:
        return PLATFORM_PRIORITY[self.platform.kind]

    def row(self, backend: AttentionBackendEnum) -> BackendRow:
        """The row of ``backend``; KeyError if the report has none (an unregistered CUSTOM)."""
        for r in self.rows:
            if r.name == backend.name:
                return r
        raise KeyError(backend.name)

    @property
    def decided_by(self) -> str:
        """How the choice was made, in words."""
        if self.how == "forced":
            return f"forced: global_force_attn_backend({self.requested.name})"
        if self.how == "env":
            return f"environment: {ENV_VAR}={self.requested.name!r}"
        return f"platform priority list for {self.platform.kind}"

    def failure_message(self) -> str:
        """One line saying why nothing was chosen, with every reason; "" if something was."""
        if self.chosen is not None:
            return ""
        where = f"{self.request} on platform {self.platform}"
        if self.requested is not None:
            reasons = "; ".join(self.row(self.requested).reasons)
            others = [r.name for r in self.rows if r.usable and r.name != self.requested.name]
            usable = f" Usable backends here: {', '.join(others) or 'none'}."
            name = self.requested.name
            if self.how == "forced":
                return f"Forced attention backend {name} cannot serve {where}: {reasons}.{usable}"
            return f"{ENV_VAR}={name!r} names attention backend {name}, which cannot serve {where}: {reasons}.{usable}"
        per_backend = " ".join(f"{r.name}: {'; '.join(r.reasons)}." for r in self.rows)
        order = ", ".join(b.name for b in self.priority)
        return f"No attention backend can serve {where} (priority list: {order}). {per_backend}"

    def format(self) -> str:
        """A plain-text table: the request, the platform, the decision and every backend's reasons."""
        chosen = "none" if self.chosen is None else f"{self.chosen.name} ({self.row(self.chosen).class_path})"
        lines = [
            "Attention backend selection",
            f"  request:    {self.request}",
            f"  platform:   {self.platform}",
            f"  priority:   {', '.join(b.name for b in self.priority)}",
            f"  decided by: {self.decided_by}",
            f"  chosen:     {chosen}",
            "",
        ]
        width = max(len("backend"), *(len(r.name) for r in self.rows))
        lines.append(f"    {'backend':<{width}}  usable  class path")
        for r in self.rows:
            mark = "*" if self.chosen is not None and r.name == self.chosen.name else " "
            path = r.class_path or "(not registered)"
            lines.append(f"  {mark} {r.name:<{width}}  {'yes' if r.usable else 'no':<6}  {path}")
            lines.extend(f"      - {reason}" for reason in r.reasons)
        if self.chosen is None:
            lines += ["", f"  error: {self.failure_message()}"]
        return "\n".join(lines)

    __str__ = format


def _make_request(
    head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse, attn_type, query_quant=False
) -> AttentionConfig:
    return AttentionConfig(
        head_size=validate_positive_int("head_size", head_size),
        dtype=validate_activation_dtype(dtype),
        kv_cache_dtype=validate_cache_dtype(kv_cache_dtype),
        block_size=validate_positive_int("block_size", block_size),
        use_mla=bool(use_mla),
        has_sink=bool(has_sink),
        use_sparse=bool(use_sparse),
        attn_type=AttentionType.parse(attn_type),
        query_quant=bool(query_quant),
    )


def _requested_backends() -> tuple[AttentionBackendEnum | None, AttentionBackendEnum | None]:
    """(forced, env-named) backend; the environment is read only when nothing is forced."""
    if _forced_attn_backend is not None:
        return _forced_attn_backend, None
    value = os.environ.get(ENV_VAR)
    if not value:
        return None, None
    name = value.strip().upper()  # case-insensitive, as `attn-stack generate --backend` is
    if name not in AttentionBackendEnum.__members__:
        raise ValueError(
            f"{ENV_VAR}={value!r} is not an attention backend. "
            f"Valid options are (any case): {', '.join(AttentionBackendEnum.__members__)}"
        )
    return None, AttentionBackendEnum[name]


def _backend_reasons(
    member: AttentionBackendEnum, request: AttentionConfig, platform: Platform
) -> tuple[str | None, list[str]]:
    """(class path or None, every reason ``member`` cannot serve ``request`` on ``platform``)."""
    try:
        path = member.get_path()
    except ValueError as e:
        return None, [f"not registered: {e}"]
    try:
        cls = member.get_class()
    except ImportError as e:
        return path, [f"import failed: {e}"]
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        return path, [f"{path} is not an AttentionBackend subclass"]
    reasons = cls.validate_configuration(
        request.head_size,
        request.dtype,
        request.kv_cache_dtype,
        request.block_size,
        use_mla=request.use_mla,
        has_sink=request.has_sink,
        use_sparse=request.use_sparse,
        attn_type=request.attn_type,
        platform=platform,
        **({"query_quant": True} if request.query_quant else {}),  # backends written before it take none
    )
    return path, list(reasons)


def _build_report(
    request: AttentionConfig,
    platform: Platform,
    forced: AttentionBackendEnum | None,
    env_backend: AttentionBackendEnum | None,
) -> SelectionReport:
    requested = forced or env_backend
    how: SelectionHow = "forced" if forced is not None else "env" if env_backend is not None else "priority"
    priority = PLATFORM_PRIORITY[platform.kind]
    rows = []
    for member in AttentionBackendEnum:
        if member is AttentionBackendEnum.CUSTOM and not member.is_overridden() and member is not requested:
            continue
        reasons = []
        if member not in priority and member is not requested:
            reasons.append(f"not in the priority list for platform {platform.kind}")
        path, why = _backend_reasons(member, request, platform)
        reasons += why
        rows.append(BackendRow(name=member.name, class_path=path, usable=not reasons, reasons=reasons))
    usable = {r.name for r in rows if r.usable}
    if requested is not None:
        chosen = requested if requested.name in usable else None
    else:
        chosen = next((b for b in priority if b.name in usable), None)
    return SelectionReport(request, platform, how, requested, chosen, rows)


@functools.lru_cache(maxsize=256)
def _cached_get_attn_backend(
    request: AttentionConfig,
    platform: Platform,
    forced: AttentionBackendEnum | None,
    env_backend: AttentionBackendEnum | None,
    overrides: tuple[tuple[str, str, str], ...],
) -> type[AttentionBackend]:
    del overrides  # only part of the key: a new override must miss the cache
    report = _build_report(request, platform, forced, env_backend)
    if report.chosen is None:
        raise ValueError(report.failure_message())
    logger.info("Using attention backend %s (%s) for %s", report.chosen.name, report.decided_by, request)
    return report.chosen.get_class()


def _apply_required_kv_cache_layout(backend: type[AttentionBackend]) -> None:
    layout = backend.get_required_kv_cache_layout()
    if layout is None:
        return
    # Imported here: metadata sits below the selector in the data flow and may import backends.
    from attn_jax.metadata import get_kv_cache_layout, set_kv_cache_layout

    previous = get_kv_cache_layout()
    set_kv_cache_layout(layout)  # pinned on every call, so a later env change cannot undo it
    if previous != layout:
        logger.info("Using %s KV cache layout for %s backend (was %s).", layout, backend.get_name(), previous)


def get_attn_backend(
    head_size: int,
    dtype,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    use_mla: bool = False,
    has_sink: bool = False,
    use_sparse: bool = False,
    attn_type: str = AttentionType.DECODER,
    *,
    platform: Platform | None = None,
    query_quant: bool = False,
) -> type[AttentionBackend]:
    """Selects the attention backend class for a layer and imports it.

    Precedence: ``global_force_attn_backend`` > ``ATTN_STACK_BACKEND`` (read now, only
    when nothing is forced) > the priority list of ``platform`` (default: this process's).
    If the backend needs a KV-cache layout, it is set with ``set_kv_cache_layout``.

    Args:
      head_size: D, the per-head dimension.
      dtype: activation dtype: float32, bfloat16 or float16 (else TypeError).
      kv_cache_dtype: one of ``attn_jax.types.CACHE_DTYPES`` (else ValueError).
      block_size: tokens per KV-cache page.
      attn_type: an ``AttentionType`` value (else ValueError).
      query_quant: FP8 attention (the layer's ``query_quant``): only backends with
        ``supports_quant_query_input`` and an e4m3 cache ("fp8" / "fp8_e4m3") serve it.

    Raises ValueError with every reason when the forced or env-named backend cannot
    serve the request, or when no backend in the priority list can.

    Example::

        backend = get_attn_backend(128, jnp.bfloat16)  # XLAAttentionBackend on CPU
    """
    request = _make_request(
        head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse, attn_type, query_quant
    )
    forced, env_backend = _requested_backends()
    backend = _cached_get_attn_backend(
        request, platform or current_platform(), forced, env_backend, overrides_snapshot()
    )
    _apply_required_kv_cache_layout(backend)
    return backend


def explain_attn_backend_selection(
    head_size: int,
    dtype,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    use_mla: bool = False,
    has_sink: bool = False,
    use_sparse: bool = False,
    attn_type: str = AttentionType.DECODER,
    *,
    platform: Platform | None = None,
    query_quant: bool = False,
) -> SelectionReport:
    """What ``get_attn_backend`` with the same arguments chooses, and why, for every backend.

    Raises only for invalid arguments or an unknown ``ATTN_STACK_BACKEND``; when no
    backend can serve, ``report.chosen`` is None and ``report.failure_message()`` says why.
    """
    request = _make_request(
        head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse, attn_type, query_quant
    )
    forced, env_backend = _requested_backends()
    return _build_report(request, platform or current_platform(), forced, env_backend)

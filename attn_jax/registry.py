"""The attention backend registry: enum members whose values are lazy class paths.

Mirrors vLLM's ``vllm.attention.backends.registry``. A member's value is the default
class path; ``register_backend`` overrides it (or fills in ``CUSTOM``) at runtime, and
``member.get_class()`` imports whatever path is current. The selector keys its cache on
``overrides_snapshot()`` so an override is seen on the very next selection.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attn_jax.backends.base import AttentionBackend


def resolve_obj_by_qualname(qualname: str) -> Any:
    """Imports ``"package.module.Name"`` and returns ``Name``; ImportError names the path."""
    module_name, _, obj_name = qualname.rpartition(".")
    if not module_name or not obj_name:
        raise ImportError(f"qualname={qualname!r} is not a 'package.module.Name' path")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"Cannot import {qualname!r}: module {module_name!r} failed to import: {e}") from e
    try:
        return getattr(module, obj_name)
    except AttributeError:
        raise ImportError(f"Cannot import {qualname!r}: module {module_name!r} has no attribute {obj_name!r}") from None


class _AttentionBackendEnumMeta(enum.EnumMeta):
    """``Enum["BAD"]`` raises ValueError listing the valid names instead of KeyError."""

    def __getitem__(cls, name: str):
        try:
            return super().__getitem__(name)
        except KeyError:
            valid = ", ".join(cls.__members__)
            raise ValueError(f"Unknown attention backend: {name!r}. Valid options are: {valid}") from None


class _BackendRegistryMixin:
    """Override-aware lookups shared by both backend families."""

    name: str
    value: str

    def get_path(self, include_classname: bool = True) -> str:
        """The class path (the override if registered), or its module if not include_classname."""
        path = _overrides_of(self).get(self, self.value)
        if not path:
            family = type(self).__name__
            mamba = ", is_mamba=True" if family == "MambaAttentionBackendEnum" else ""
            raise ValueError(
                f"Backend {family}.{self.name} must be registered before use: "
                f"register_backend({family}.{self.name}{mamba}, class_path='your.module.YourBackend') "
                f"or decorate the class with @register_backend({family}.{self.name}{mamba})"
            )
        return path if include_classname else path.rsplit(".", 1)[0]

    def get_class(self) -> type[AttentionBackend]:
        """Imports and returns the backend class; ImportError if it cannot be imported."""
        return resolve_obj_by_qualname(self.get_path())

    def is_overridden(self) -> bool:
        """True if ``register_backend`` has set a class path for this member."""
        return self in _overrides_of(self)

    def clear_override(self) -> None:
        """Forgets the override; the member reverts to its default path."""
        _overrides_of(self).pop(self, None)


class AttentionBackendEnum(_BackendRegistryMixin, enum.Enum, metaclass=_AttentionBackendEnumMeta):
    """Every attention backend; ``member.get_class()`` respects ``register_backend`` overrides."""

    XLA = "attn_jax.backends.xla.XLAAttentionBackend"
    PALLAS_TPU = "attn_jax.backends.pallas_tpu.PallasTPUAttentionBackend"
    PALLAS_GPU = "attn_jax.backends.pallas_gpu.PallasGPUAttentionBackend"
    XLA_MLA = "attn_jax.backends.mla_xla.XLAMLABackend"
    PALLAS_MLA_TPU = "attn_jax.backends.mla_pallas.PallasMLATPUBackend"
    PALLAS_MLA_GPU = "attn_jax.backends.mla_pallas.PallasMLAGPUBackend"
    CUSTOM = ""
    """Third-party backend: empty until registered with ``register_backend``."""


class MambaAttentionBackendEnum(_BackendRegistryMixin, enum.Enum, metaclass=_AttentionBackendEnumMeta):
    """Mamba-style backends, for registry parity with vLLM; attn-stack ships none.

    Their default paths do not exist: ``get_class()`` raises ImportError unless a
    backend was registered with ``register_backend(member, is_mamba=True, ...)``.
    """

    MAMBA1 = "attn_jax.backends.mamba.mamba1.Mamba1AttentionBackend"
    MAMBA2 = "attn_jax.backends.mamba.mamba2.Mamba2AttentionBackend"
    SHORT_CONV = "attn_jax.backends.mamba.short_conv.ShortConvAttentionBackend"
    LINEAR = "attn_jax.backends.mamba.linear.LinearAttentionBackend"
    GDN_ATTN = "attn_jax.backends.mamba.gdn.GDNAttentionBackend"
    CUSTOM = ""

    def get_class(self) -> type[AttentionBackend]:
        try:
            return super().get_class()
        except ImportError as e:
            if self.is_overridden():
                raise
            raise ImportError(
                f"attn-stack ships no Mamba kernels: MambaAttentionBackendEnum.{self.name} has no "
                f"implementation at {self.get_path()!r}. Register one with "
                f"register_backend(MambaAttentionBackendEnum.{self.name}, is_mamba=True, "
                f"class_path='your.module.YourBackend')"
            ) from e


_ATTN_OVERRIDES: dict[AttentionBackendEnum, str] = {}
_MAMBA_ATTN_OVERRIDES: dict[MambaAttentionBackendEnum, str] = {}


def _overrides_of(member: _BackendRegistryMixin) -> dict:
    return _MAMBA_ATTN_OVERRIDES if isinstance(member, MambaAttentionBackendEnum) else _ATTN_OVERRIDES


def overrides_snapshot() -> tuple[tuple[str, str, str], ...]:
    """Every current override as sorted (family, member name, class path) triples; hashable."""
    items = [*_ATTN_OVERRIDES.items(), *_MAMBA_ATTN_OVERRIDES.items()]
    return tuple(sorted((type(m).__name__, m.name, path) for m, path in items))


def register_backend(
    backend: AttentionBackendEnum | MambaAttentionBackendEnum,
    is_mamba: bool = False,
    class_path: str | None = None,
) -> Callable[[type], type]:
    """Registers or overrides the class behind ``backend``.

    With ``class_path`` it registers that path now and returns an identity decorator;
    without, it returns a decorator that registers the decorated class (which must be
    defined at module level, so its path can be imported again). ``is_mamba`` must be
    True exactly for ``MambaAttentionBackendEnum`` members.

    Example::

        @register_backend(AttentionBackendEnum.CUSTOM)
        class MyBackend(AttentionBackend): ...

        register_backend(AttentionBackendEnum.CUSTOM, class_path="my.module.MyBackend")
    """
    if not isinstance(is_mamba, bool):
        raise TypeError(
            f"is_mamba={is_mamba!r} must be a bool (the order is backend, is_mamba, class_path); "
            f"to register a class path pass class_path={is_mamba!r}"
        )
    if not isinstance(backend, (AttentionBackendEnum, MambaAttentionBackendEnum)):
        raise TypeError(
            f"backend={backend!r} must be a member of AttentionBackendEnum "
            f"({', '.join(AttentionBackendEnum.__members__)}) or MambaAttentionBackendEnum "
            f"({', '.join(MambaAttentionBackendEnum.__members__)})"
        )
    if is_mamba != isinstance(backend, MambaAttentionBackendEnum):
        raise ValueError(
            f"is_mamba={is_mamba!r} does not match backend={backend}: "
            f"{type(backend).__name__} members need is_mamba={not is_mamba!r}"
        )
    overrides = _overrides_of(backend)

    def decorator(cls: type) -> type:
        if "." in cls.__qualname__:
            raise ValueError(
                f"Cannot register {cls.__module__}.{cls.__qualname__}: it is defined inside a "
                f"function or class, so its path cannot be imported. Define it at module level "
                f"or pass class_path="
            )
        overrides[backend] = f"{cls.__module__}.{cls.__qualname__}"
        return cls

    if class_path is None:
        return decorator
    if not isinstance(class_path, str) or "." not in class_path.strip("."):
        raise ValueError(f"class_path={class_path!r} must be a 'package.module.ClassName' string")
    overrides[backend] = class_path
    return lambda cls: cls

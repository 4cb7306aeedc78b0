"""The backend registry: enum lookups, lazy class paths, overrides and registration."""

from __future__ import annotations

import pytest

from attn_jax.backends.base import AttentionBackend
from attn_jax.backends.pallas_gpu import PallasGPUAttentionBackend
from attn_jax.backends.pallas_tpu import PallasTPUAttentionBackend
from attn_jax.backends.xla import XLAAttentionBackend
from attn_jax.registry import (
    AttentionBackendEnum,
    MambaAttentionBackendEnum,
    overrides_snapshot,
    register_backend,
    resolve_obj_by_qualname,
)

ABE = AttentionBackendEnum
MBE = MambaAttentionBackendEnum

PALLAS_AND_MLA = ["XLA", "PALLAS_TPU", "PALLAS_GPU", "XLA_MLA", "PALLAS_MLA_TPU", "PALLAS_MLA_GPU"]


class MyBackend(XLAAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"


class MyMambaBackend:
    pass


def test_members():
    assert [m.name for m in ABE] == [*PALLAS_AND_MLA, "CUSTOM"]
    assert [m.name for m in MBE] == ["MAMBA1", "MAMBA2", "SHORT_CONV", "LINEAR", "GDN_ATTN", "CUSTOM"]
    assert ABE["XLA"] is ABE.XLA
    assert MBE["LINEAR"] is MBE.LINEAR


def test_unknown_backend_name_lists_valid_options():
    with pytest.raises(ValueError) as e:
        ABE["BAD"]
    assert str(e.value) == (
        "Unknown attention backend: 'BAD'. Valid options are: "
        "XLA, PALLAS_TPU, PALLAS_GPU, XLA_MLA, PALLAS_MLA_TPU, PALLAS_MLA_GPU, CUSTOM"
    )


def test_unknown_mamba_backend_name_lists_valid_options():
    valid = "MAMBA1, MAMBA2, SHORT_CONV, LINEAR, GDN_ATTN, CUSTOM"
    with pytest.raises(ValueError, match=rf"'BAD'. Valid options are: {valid}"):
        MBE["BAD"]


@pytest.mark.parametrize(
    ("member", "cls"),
    [
        (ABE.XLA, XLAAttentionBackend),
        (ABE.PALLAS_TPU, PallasTPUAttentionBackend),
        (ABE.PALLAS_GPU, PallasGPUAttentionBackend),
    ],
)
def test_default_paths_resolve_to_backends(member, cls):
    assert member.get_path() == f"{cls.__module__}.{cls.__qualname__}"
    assert member.get_path(include_classname=False) == cls.__module__
    assert member.get_class() is cls
    assert issubclass(cls, AttentionBackend)
    assert cls.get_name() == member.name
    assert not member.is_overridden()


@pytest.mark.parametrize("enum_cls", [ABE, MBE])
def test_unregistered_custom_says_how_to_register(enum_cls):
    mamba = ", is_mamba=True" if enum_cls is MBE else ""
    expected = f"register_backend({enum_cls.__name__}.CUSTOM{mamba}, class_path="
    with pytest.raises(ValueError, match=r"CUSTOM must be registered before use") as e:
        enum_cls.CUSTOM.get_path()
    assert expected in str(e.value)
    with pytest.raises(ValueError, match=r"must be registered"):
        enum_cls.CUSTOM.get_class()


def test_mamba_defaults_are_distinct_and_not_shipped():
    members = [m for m in MBE if m is not MBE.CUSTOM]
    paths = [m.get_path() for m in members]
    assert len(set(paths)) == len(paths)
    assert all(p.startswith("attn_jax.backends.mamba.") for p in paths)
    for m in members:
        with pytest.raises(ImportError) as e:
            m.get_class()
        msg = str(e.value)
        assert "attn-stack ships no Mamba kernels" in msg
        assert m.get_path() in msg
        assert f"register_backend(MambaAttentionBackendEnum.{m.name}, is_mamba=True, class_path=" in msg


def test_register_custom_with_decorator():
    decorated = register_backend(ABE.CUSTOM)(MyBackend)
    assert decorated is MyBackend
    assert ABE.CUSTOM.is_overridden()
    assert ABE.CUSTOM.get_path() == f"{__name__}.MyBackend"
    assert ABE.CUSTOM.get_path(include_classname=False) == __name__
    assert ABE.CUSTOM.get_class() is MyBackend
    ABE.CUSTOM.clear_override()
    assert not ABE.CUSTOM.is_overridden()
    with pytest.raises(ValueError, match="must be registered"):
        ABE.CUSTOM.get_path()


def test_register_custom_directly():
    identity = register_backend(ABE.CUSTOM, class_path=f"{__name__}.MyBackend")
    assert ABE.CUSTOM.is_overridden()
    assert ABE.CUSTOM.get_class() is MyBackend
    assert identity(MyMambaBackend) is MyMambaBackend


def test_register_positional_order_is_backend_is_mamba_class_path():
    register_backend(ABE.CUSTOM, False, f"{__name__}.MyBackend")
    assert ABE.CUSTOM.get_class() is MyBackend
    register_backend(MBE.CUSTOM, True, f"{__name__}.MyMambaBackend")
    assert MBE.CUSTOM.get_class() is MyMambaBackend


def test_override_existing_backend_and_clear():
    register_backend(ABE.XLA, class_path=f"{__name__}.MyBackend")
    assert ABE.XLA.is_overridden()
    assert ABE.XLA.get_class() is MyBackend
    assert not ABE.PALLAS_TPU.is_overridden()
    ABE.XLA.clear_override()
    assert not ABE.XLA.is_overridden()
    assert ABE.XLA.get_class() is XLAAttentionBackend
    ABE.XLA.clear_override()  # clearing twice is a no-op


def test_register_mamba_with_decorator():
    register_backend(MBE.MAMBA2, is_mamba=True)(MyMambaBackend)
    assert MBE.MAMBA2.get_class() is MyMambaBackend
    assert not ABE.XLA.is_overridden()
    MBE.MAMBA2.clear_override()
    with pytest.raises(ImportError, match="ships no Mamba kernels"):
        MBE.MAMBA2.get_class()


def test_overridden_mamba_with_bad_path_reports_the_path():
    register_backend(MBE.LINEAR, is_mamba=True, class_path="no_such_pkg.Backend")
    with pytest.raises(ImportError, match=r"Cannot import 'no_such_pkg.Backend'") as e:
        MBE.LINEAR.get_class()
    assert "ships no Mamba kernels" not in str(e.value)


def test_is_mamba_must_match_attention_family():
    with pytest.raises(ValueError, match=r"is_mamba=True does not match backend=AttentionBackendEnum.CUSTOM"):
        register_backend(ABE.CUSTOM, is_mamba=True, class_path=f"{__name__}.MyBackend")
    assert not ABE.CUSTOM.is_overridden()


def test_is_mamba_must_match_mamba_family():
    msg = r"is_mamba=False does not match backend=MambaAttentionBackendEnum.MAMBA1.*is_mamba=True"
    with pytest.raises(ValueError, match=msg):
        register_backend(MBE.MAMBA1)
    assert not MBE.MAMBA1.is_overridden()


def test_class_path_passed_as_is_mamba_is_a_type_error():
    with pytest.raises(TypeError, match=r"is_mamba='my.module.Cls' must be a bool.*class_path='my.module.Cls'"):
        register_backend(ABE.CUSTOM, "my.module.Cls")


def test_register_rejects_non_members():
    with pytest.raises(TypeError, match=r"backend='XLA' must be a member of AttentionBackendEnum \(XLA, PALLAS_TPU"):
        register_backend("XLA", class_path=f"{__name__}.MyBackend")


@pytest.mark.parametrize("path", ["", "NoModule", ".", 3])
def test_register_rejects_bad_class_path(path):
    with pytest.raises(ValueError, match=rf"class_path={path!r} must be a 'package.module.ClassName' string"):
        register_backend(ABE.CUSTOM, class_path=path)


def test_decorator_rejects_classes_that_cannot_be_imported_again():
    class Local(XLAAttentionBackend):
        pass

    msg = r"test_decorator_rejects_classes_that_cannot_be_imported_again.<locals>.Local.*module level"
    with pytest.raises(ValueError, match=msg):
        register_backend(ABE.CUSTOM)(Local)
    assert not ABE.CUSTOM.is_overridden()


def test_overrides_snapshot_tracks_registrations():
    assert overrides_snapshot() == ()
    register_backend(ABE.XLA, class_path=f"{__name__}.MyBackend")
    register_backend(MBE.MAMBA1, is_mamba=True, class_path=f"{__name__}.MyMambaBackend")
    snap = overrides_snapshot()
    hash(snap)
    assert snap == (
        ("AttentionBackendEnum", "XLA", f"{__name__}.MyBackend"),
        ("MambaAttentionBackendEnum", "MAMBA1", f"{__name__}.MyMambaBackend"),
    )
    ABE.XLA.clear_override()
    assert overrides_snapshot() == (("MambaAttentionBackendEnum", "MAMBA1", f"{__name__}.MyMambaBackend"),)


def test_resolve_obj_by_qualname():
    assert resolve_obj_by_qualname("attn_jax.backends.xla.XLAAttentionBackend") is XLAAttentionBackend


def test_resolve_missing_module_names_the_path():
    msg = r"Cannot import 'no_such_pkg.mod.Cls': module 'no_such_pkg.mod' failed to import"
    with pytest.raises(ImportError, match=msg):
        resolve_obj_by_qualname("no_such_pkg.mod.Cls")


def test_resolve_missing_attribute_names_the_path():
    msg = r"Cannot import 'attn_jax.backends.xla.Nope': module 'attn_jax.backends.xla' has no attribute 'Nope'"
    with pytest.raises(ImportError, match=msg):
        resolve_obj_by_qualname("attn_jax.backends.xla.Nope")


def test_resolve_rejects_a_bare_name():
    with pytest.raises(ImportError, match=r"qualname='Nope' is not a 'package.module.Name' path"):
        resolve_obj_by_qualname("Nope")

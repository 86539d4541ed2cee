"""plans/ packages: each package's ``__init__`` is its face, and the flat modules they
replaced still import, giving the very objects the packages hold."""

import importlib
import pkgutil

import pytest

import areal_fn.plans as plans

#: old flat module -> the package module that holds its code now
OLD_PATHS = {
    "transfer_apply": "transfer.apply",
    "transfer_bound": "transfer.bound",
    "transfer_classes": "transfer.classes",
    "transfer_records": "transfer.records",
    "checkpoint_keyed": "checkpoint.keyed",
    "checkpoint_manifest": "checkpoint.manifest",
    "checkpoint_read": "checkpoint.read",
    "checkpoint_storage": "checkpoint.storage",
    "checkpoint_write": "checkpoint.write",
}


def _public(module: object) -> dict[str, object]:
    return {
        k: v
        for k, v in vars(module).items()
        if not k.startswith("_") and getattr(v, "__module__", None) == module.__name__  # type: ignore[attr-defined]
    }


@pytest.mark.parametrize(("old", "new"), sorted(OLD_PATHS.items()))
def test_old_path_gives_the_same_objects(old: str, new: str) -> None:
    shim = importlib.import_module(f"areal_fn.plans.{old}")
    home = importlib.import_module(f"areal_fn.plans.{new}")
    defined = _public(home)
    assert defined, f"{home.__name__} defines no public name"
    for name, obj in defined.items():
        assert getattr(shim, name) is obj, (old, name)


@pytest.mark.parametrize("package", ["transfer", "checkpoint"])
def test_face_names_come_from_the_package(package: str) -> None:
    face = importlib.import_module(f"areal_fn.plans.{package}")
    names = [n for n in vars(face) if not n.startswith("_")]
    inner = {m.name for m in pkgutil.iter_modules(face.__path__)}
    assert inner, package
    for name in names:
        obj = getattr(face, name)
        home = getattr(obj, "__module__", "") or ""
        if home.startswith("areal_fn."):
            assert home.startswith(f"areal_fn.plans.{package}."), (name, home)


def test_every_old_path_is_listed() -> None:
    """Every flat module named after a package is an old path of it."""
    flat = {m.name for m in pkgutil.iter_modules(plans.__path__) if not m.ispkg}
    for package in ("transfer", "checkpoint"):
        assert {f for f in flat if f.startswith(package + "_")} == {
            o for o in OLD_PATHS if o.startswith(package + "_")
        }

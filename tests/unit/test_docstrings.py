"""Every public name has a docstring: ``rmq_async.__all__`` and the public members of its
classes (methods, properties, class and static methods defined by the library)."""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import re
from collections.abc import Iterator

import rmq_async


def _own_members(cls: type) -> Iterator[tuple[str, object]]:
    """Public members a library class defines (or inherits from another library class)."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("rmq_async"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            yield f"{klass.__qualname__}.{name}", value


def _needs_doc(value: object) -> object | None:
    """The object whose ``__doc__`` documents ``value``, or ``None`` for plain data."""
    if isinstance(value, staticmethod | classmethod):
        return value.__func__
    if isinstance(value, property):
        return value.fget
    if inspect.isfunction(value):
        return value
    return None


def _alias_docstring(name: str) -> str | None:
    """The string right after ``name = ...`` in the module rmq_async imports ``name`` from
    (how a type alias, which has no ``__doc__`` of its own, is documented)."""
    init = ast.parse(inspect.getsource(rmq_async))
    module = next((node.module for node in init.body if isinstance(node, ast.ImportFrom)
                   and any(a.name == name for a in node.names)), None)
    if module is None:
        return None
    body = ast.parse(inspect.getsource(importlib.import_module(module))).body
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                 for t in node.targets)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            return after.value.value
    return None


def missing_docstrings() -> list[str]:
    missing: list[str] = []
    for name in rmq_async.__all__:
        obj = getattr(rmq_async, name)
        if name.startswith("__"):
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
            documented = (inspect.getdoc(obj) or "").strip()
        else:  # a type alias or constant: an attribute docstring in its module
            documented = (_alias_docstring(name) or "").strip()
        if not documented:
            missing.append(name)
        if not inspect.isclass(obj):
            continue
        for qual, value in _own_members(obj):
            target = _needs_doc(value)
            if target is not None and not (getattr(target, "__doc__", None) or "").strip():
                missing.append(qual)
    return sorted(set(missing))


def test_every_public_name_has_a_docstring() -> None:
    missing = missing_docstrings()
    assert not missing, "public names without a docstring:\n  " + "\n  ".join(missing)


def test_the_check_sees_methods_and_properties() -> None:
    names = {q for q, v in _own_members(rmq_async.PushConsumer) if _needs_doc(v) is not None}
    assert {"PushConsumer.subscribe", "PushConsumer.start", "PushConsumer.stop"} <= names
    assert "App.is_running" in {q for q, _ in _own_members(rmq_async.App)}


def test_the_migration_table_lists_every_java_option() -> None:
    from pathlib import Path

    from rmq_async.consumer.options import JAVA_OPTION_NAMES

    page = (Path(__file__).resolve().parents[2] / "docs" / "migration.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| `(\w+)` \|", page, re.M))
    assert {k: v for k, (v, _) in JAVA_OPTION_NAMES.items()} == rows

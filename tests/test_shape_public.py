"""The public surface is deliberate: ``kombu_delay.__all__`` names exactly what the package
exports, every name in it imports, and nothing a user meets (an error, a result type) is left out."""

from __future__ import annotations
import __future__

import dataclasses
import inspect
import types
import typing

import kombu_delay
from kombu_delay import errors


def test_all_names_exactly_the_public_names() -> None:
    public = {
        name
        for name, value in vars(kombu_delay).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and value is not __future__.annotations
    }
    assert len(kombu_delay.__all__) == len(set(kombu_delay.__all__))
    assert set(kombu_delay.__all__) == public | {"__version__"}


def test_every_name_in_all_imports() -> None:
    for name in kombu_delay.__all__:
        namespace: dict[str, object] = {}
        exec(f"from kombu_delay import {name}", namespace)
        assert namespace[name] is getattr(kombu_delay, name)


def test_every_error_is_exported() -> None:
    tree = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, errors.KombuDelayError)
    }
    assert tree <= set(kombu_delay.__all__)


def test_every_error_shows_its_words_in_its_repr() -> None:
    # redis-py 8 gives its errors a repr of their kind alone ("server:ResponseError"), and so it
    # gave those of ours that are also its own: a log of repr(exc) lost the key a WrongTypeKey names.
    for name, value in vars(errors).items():
        if inspect.isclass(value) and issubclass(value, errors.KombuDelayError):
            error = value("'a:b' holds a string")
            assert repr(error) == f"{name}(\"'a:b' holds a string\")", repr(error)


def _our_classes(hint: object) -> set[type]:
    """The kombu_delay classes a type hint names, however nested (``list[Slot] | None``)."""
    found = {hint} if inspect.isclass(hint) and hint.__module__.startswith("kombu_delay") else set()
    for arg in typing.get_args(hint):
        found |= _our_classes(arg)
    return found


def test_every_result_type_of_delay_control_is_exported() -> None:
    seen: set[type] = set()
    todo: set[type] = set()
    for name, method in inspect.getmembers(kombu_delay.DelayControl, inspect.isfunction):
        if not name.startswith("_"):
            todo |= _our_classes(typing.get_type_hints(method).get("return"))
    while todo:
        kind = todo.pop()
        seen.add(kind)
        if dataclasses.is_dataclass(kind):
            for hint in typing.get_type_hints(kind).values():
                todo |= _our_classes(hint) - seen
    assert {kombu_delay.Page, kombu_delay.Stats, kombu_delay.Slot, kombu_delay.ScheduledMessage} <= seen
    assert {kind.__name__ for kind in seen} <= set(kombu_delay.__all__)

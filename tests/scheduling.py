"""The order in which ``make test``'s workers take the test files: the longest first.

``make test`` runs pytest-xdist workers that each take a whole file at a time
(``--dist loadfile``) in the order of collection (``--no-loadscope-reorder``; xdist's own order
puts the files with the most tests first, which leaves a file of one long test, such as the
benchmark smoke, for the end, where it keeps one worker busy minutes after the other ran out of
files). Here the files holding tests marked ``@pytest.mark.slow(seconds=N)`` move to the front,
the heaviest (the sum of their marks) first; every other file keeps its place. ``N`` is about
what the test took in a full ``make test`` on two cores: it orders the files and nothing else.
"""

from __future__ import annotations

import pytest


def slow_seconds(item: pytest.Item) -> float:
    """The ``seconds`` of the item's ``slow`` mark (0 for an item without one)."""
    mark = item.get_closest_marker("slow")
    if mark is None:
        return 0.0
    return float(mark.kwargs.get("seconds", 0.0))


def file_of(item: pytest.Item) -> str:
    """The file's part of the item's node id: xdist's ``loadfile`` unit."""
    return item.nodeid.split("::", 1)[0]


def file_weights(items: list[pytest.Item]) -> dict[str, float]:
    """The sum of the slow marks of each file's items."""
    weights: dict[str, float] = {}
    for item in items:
        path = file_of(item)
        weights[path] = weights.get(path, 0.0) + slow_seconds(item)
    return weights


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    weights = file_weights(items)
    # A stable sort: a file's items stay together and in their order, and files of equal
    # weight (every file without a slow test) keep the order they were collected in.
    items.sort(key=lambda item: -weights[file_of(item)])

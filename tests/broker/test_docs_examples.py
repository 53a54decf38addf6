"""The code examples of the documentation (docs/examples/*.py, included into the pages) run
against the session broker and give the results the pages describe."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rmq_async.devbroker import LocalRocketMQ
from tests.helpers import unique

pytestmark = pytest.mark.broker

DOCS = Path(__file__).resolve().parents[2] / "docs"
EXAMPLES = DOCS / "examples"

EXPECTED: dict[str, Any] = {
    "getting_started": sorted(f"hello {i}" for i in range(10)),
    "retry": [0, 1],
    "payloads": "orders 0, 1, 2",
    "orderly": {f"order-{k}": list(range(10)) for k in (1, 2, 3)},
    "broadcasting": [5, 5],
    "lag": 3,
    "java_options": {"consume_timeout": 900.0, "suspend_current_queue_time": 0.5,
                     "consume_concurrency": 8},
}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_checked_and_included_in_a_page() -> None:
    files = {p.stem for p in EXAMPLES.glob("*.py")}
    assert files == set(EXPECTED)
    included = set()
    for page in DOCS.glob("*.md"):
        included |= set(re.findall(r'--8<-- "([\w]+)\.py"', page.read_text()))
    assert included == files


def test_python_blocks_of_the_pages_are_included_examples() -> None:
    for page in DOCS.glob("*.md"):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            assert re.fullmatch(r'--8<-- "\w+\.py"\n', block), (page.name, block)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", sorted(EXPECTED))
async def test_docs_example_runs(name: str, rocketmq: LocalRocketMQ) -> None:
    topic = unique(f"T_docs_{name}")
    await rocketmq.create_topic(topic, queues=4)
    module = _load(name)
    result = await module.main(rocketmq.namesrv_addr, topic)
    if name == "payloads":
        assert result == [module.Order(i, 9.5 * i) for i in range(3)]
    else:
        assert result == EXPECTED[name]

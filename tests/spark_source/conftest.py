"""Fixtures of the Spark source tests: one local SparkSession with ``format("rocketmq")``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

pytest.importorskip("pyspark", reason="needs the spark extra")

from tests.spark_source.session import source_spark

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = source_spark()
    yield session
    session.stop()

"""A local PySpark session shared by every test in tests/spark/ (starting one takes seconds)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

pytest.importorskip("pyspark", reason="needs the spark extra")

from tests.spark.session import local_spark

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = local_spark()
    yield session
    session.stop()

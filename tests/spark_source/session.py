"""The SparkSession of the source tests: ``local[2]`` whose Python workers run this interpreter."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tests.spark.session import local_spark

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: ``make test-spark-source-full`` (RMQ_SPARK_SOURCE_FULL=1) runs the acceptance sizes.
FULL = os.environ.get("RMQ_SPARK_SOURCE_FULL") == "1"


def source_spark(app_name: str = "rmq_async-source-tests") -> SparkSession:
    """The tests' local session (:func:`tests.spark.session.local_spark`) with the ``rocketmq``
    format registered.

    The data source runs in Spark's Python workers (planning on the driver side, reads in the
    executors); they must import rmq_async, so they run the interpreter of the tests, which
    ``local_spark`` sets.
    """
    from rmq_async.sources.spark import register

    session = local_spark(app_name)
    register(session)
    return session

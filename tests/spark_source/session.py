"""The SparkSession of the source tests: ``local[2]`` whose Python workers run this interpreter."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: ``make test-spark-source-full`` (RMQ_SPARK_SOURCE_FULL=1) runs the acceptance sizes.
FULL = os.environ.get("RMQ_SPARK_SOURCE_FULL") == "1"


def source_spark(app_name: str = "rmq_async-source-tests") -> SparkSession:
    """A quiet local session with the ``rocketmq`` format registered.

    The data source runs in Spark's Python workers (planning on the driver side, reads in the
    executors); they must import rmq_async, so they run the interpreter of the tests.
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from rmq_async.sources.spark import register

    session = (
        SparkSession.builder.master("local[2]")
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    return session

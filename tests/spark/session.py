"""The local SparkSession the Spark tests share (and the subprocess consumer of the broker tests)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def local_spark(app_name: str = "rmq_async-tests") -> SparkSession:
    """A quiet ``local[2]`` session tuned for short test runs (``getOrCreate``: one per process).

    Spark's Python workers run this interpreter (the one with rmq_async and its dependencies),
    whichever test module creates the process's session first.
    """
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.pyspark.python", sys.executable)
        # Short-lived test JVM: the C1 compiler alone warms up much faster (the first jobs
        # otherwise dominate the run time on a 2-core machine); a serial GC suits the small heap.
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    return session

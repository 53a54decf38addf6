"""A Spark driver for the source tests, run as a process of its own (so it can be SIGKILLed).

``python -m tests.spark_source.stream_driver '<json spec>'`` streams ``format("rocketmq")`` into
Parquet with a checkpoint. Spec keys: ``namesrv``, ``topic``, ``path``, ``checkpoint``,
``options`` (extra source options), ``available_now`` (true: read what is there when the
query starts, then exit; false: run until killed), ``master`` (default ``local[2]``),
``conf`` (extra Spark settings).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main(spec: dict[str, Any]) -> None:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from rmq_async.sources.spark import register

    builder = (
        SparkSession.builder.master(spec.get("master", "local[2]"))
        .appName("rmq_async-source-driver")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
    )
    for key, value in spec.get("conf", {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    reader = (spark.readStream.format("rocketmq")
              .option("namesrv", spec["namesrv"])
              .option("topics", spec["topic"])
              .option("startingOffsets", "earliest"))
    for key, value in spec.get("options", {}).items():
        reader = reader.option(key, str(value))
    df = reader.load()
    writer = (df.writeStream.format("parquet")
              .option("path", spec["path"])
              .option("checkpointLocation", spec["checkpoint"]))
    if spec.get("available_now"):
        writer = writer.trigger(availableNow=True)
    t0 = time.monotonic()
    query = writer.start()
    print(f"STARTED {os.getpid()}", flush=True)
    query.awaitTermination()
    batch_rows = [p.numInputRows for p in query.recentProgress if p.numInputRows]
    print(f"DONE {json.dumps({'batch_rows': batch_rows, 'seconds': round(time.monotonic() - t0, 1)})}",
          flush=True)
    spark.stop()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

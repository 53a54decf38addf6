"""Sources: RocketMQ read by an engine that distributes the work itself.

:mod:`rmq_async.sources.spark` is a Spark data source (format ``"rocketmq"``) built on PySpark's
Python Data Source API: the planner reads routes and offsets on the driver, and each executor task
pulls one queue's offset range with the project's own client. It needs the ``spark`` extra
(``pip install 'rmq_async[spark]'``). :mod:`rmq_async.sources.ranges` holds the parts that need
no Spark: option parsing, offset positions, planning and the reading of one queue's range; this
package imports neither PySpark nor pyarrow.
"""

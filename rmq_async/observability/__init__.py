"""Metrics and tracing for consumers, each behind an optional extra.

* :mod:`rmq_async.observability.prometheus` (extra ``prometheus``): Prometheus metrics of a
  consumer, read from its statistics at scrape time, and an HTTP endpoint serving them.
* :mod:`rmq_async.observability.otel` (extra ``otel``): an OpenTelemetry span per consume call,
  as a consume middleware.

Nothing here is imported by the consumer itself; import the module you use.
"""

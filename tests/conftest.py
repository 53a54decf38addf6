"""Test-suite wiring: the real local RocketMQ fixtures (``rocketmq``, ``topic``)."""

pytest_plugins = [
    "rmq_async.devbroker.pytest_plugin",
    "tests.hang_report",
    "tests.error_tree",
    "tests.scheduling",
]

import logging  # noqa: E402

import structlog  # noqa: E402

# Keep test output readable: the library logs at debug level on every connection.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))

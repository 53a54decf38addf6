"""Test-suite wiring: the real local RocketMQ fixtures (``rocketmq``, ``topic``)."""

pytest_plugins = ["rmq_async.devbroker.pytest_plugin"]

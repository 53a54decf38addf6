"""``python -m rmq_async.cli``: the ``rmq-async`` command."""

from rmq_async.cli import console

console()

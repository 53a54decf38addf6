"""``python -m rmq_async.devbroker up|down|status|fetch``."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())

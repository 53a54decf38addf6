# Types of the compiled codec (rmq_async/protocol/_cmessage.pyx).
from collections.abc import Callable
from typing import Any

from .types import MessageExt

def install(
    decompress: Callable[[bytes, int, int], bytes],
    host6: Callable[[bytes, int], tuple[str, str]],
) -> None: ...
def decode_records(
    data: bytes,
    out: list[MessageExt],
    decompress: bool,
    unwrap_batch: bool,
    max_body_size: int,
    limit: int,
) -> None: ...
def decode_properties(text: str) -> dict[str, str]: ...
def parse_raw_properties(raw: bytes) -> dict[str, str]: ...
def find_raw_property(raw: bytes, name: str) -> str | None: ...
def message_columns(msgs: list[MessageExt]) -> dict[str, Any] | None: ...

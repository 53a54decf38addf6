"""Subscription expressions (TAG and SQL92), tag hash codes and the client-side tag re-filter."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rmq_async.errors import InvalidArgumentError

from .jsonutil import java_hashmap_order, java_int_set_order, java_string_hash

__all__ = [
    "EXPRESSION_SQL92",
    "EXPRESSION_TAG",
    "SUB_ALL",
    "SubscriptionData",
    "build_subscription",
    "java_string_hash",
    "tag_matches",
]

SUB_ALL = "*"
EXPRESSION_TAG = "TAG"
EXPRESSION_SQL92 = "SQL92"

# Java String.trim() removes every char <= U+0020, and nothing else.
_JAVA_TRIM = "".join(chr(c) for c in range(0x21))


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class SubscriptionData:
    """One topic subscription as sent in heartbeats (Java ``SubscriptionData``).

    ``tags_set`` and ``code_set`` keep the expression's order (duplicates removed);
    :meth:`to_json` writes them in the iteration order of the Java ``HashSet`` they are.
    """

    topic: str
    sub_string: str = SUB_ALL
    tags_set: list[str] = field(default_factory=list)
    code_set: list[int] = field(default_factory=list)
    expression_type: str = EXPRESSION_TAG
    sub_version: int = field(default_factory=_now_ms)
    class_filter_mode: bool = False

    @property
    def is_all(self) -> bool:
        """True when every message of the topic is wanted (``*``, TAG type)."""
        return self.sub_string == SUB_ALL and self.expression_type == EXPRESSION_TAG

    def java_hash_code(self) -> int:
        """Java ``SubscriptionData.hashCode`` (its sets hash as the sum of their elements).

        Decides where the subscription lands in the ``HashSet`` a Java client sends in its
        heartbeat, so :class:`~rmq_async.protocol.bodies.ConsumerData` writes the same order.
        """
        acc = 31 + (1231 if self.class_filter_mode else 1237)
        acc = 31 * acc + sum(self.code_set)
        acc = 31 * acc + java_string_hash(self.sub_string)
        acc = 31 * acc + sum(java_string_hash(t) for t in self.tags_set)
        acc = 31 * acc + java_string_hash(self.topic)
        acc = 31 * acc + java_string_hash(self.expression_type)
        acc &= 0xFFFFFFFF
        return acc - (1 << 32) if acc >= (1 << 31) else acc

    def to_json(self) -> dict[str, Any]:
        """The fastjson bean as a dict (``fastjson_dumps`` sorts the keys)."""
        return {
            "classFilterMode": self.class_filter_mode,
            "codeSet": java_int_set_order(self.code_set),
            "expressionType": self.expression_type,
            "subString": self.sub_string,
            "subVersion": self.sub_version,
            "tagsSet": java_hashmap_order(self.tags_set),
            "topic": self.topic,
        }

    def json_value(self) -> dict[str, Any]:
        return self.to_json()


def build_subscription(
    topic: str,
    expression: str | None,
    *,
    sub_version: int | None = None,
    expression_type: str | None = None,
) -> SubscriptionData:
    """Parse a subscription expression as Java's ``FilterAPI`` does.

    TAG (default): ``None``, ``""`` or ``"*"`` subscribe to everything; otherwise the text is
    split on ``||``, pieces are trimmed and empty ones dropped; each tag and its Java hash code
    are recorded. An expression that leaves no tag at all (``"||"``, ``"  "``) raises
    :class:`ValueError` (Java would accept some of these and then match nothing on the broker).
    SQL92: the expression is kept as is and must not be blank.
    """
    version = _now_ms() if sub_version is None else sub_version
    etype = expression_type or EXPRESSION_TAG
    if etype == EXPRESSION_SQL92:
        if expression is None or not expression.strip():
            raise InvalidArgumentError("an SQL92 subscription needs a non-empty expression")
        return SubscriptionData(
            topic, expression, expression_type=EXPRESSION_SQL92, sub_version=version
        )
    if etype != EXPRESSION_TAG:
        raise InvalidArgumentError(f"unknown expression type {etype!r} (expected TAG or SQL92)")
    if expression is None or expression == "" or expression == SUB_ALL:
        return SubscriptionData(topic, SUB_ALL, sub_version=version)
    tags: list[str] = []
    seen: set[str] = set()
    for piece in expression.split("||"):
        tag = piece.strip(_JAVA_TRIM)
        if tag and tag not in seen:
            seen.add(tag)
            tags.append(tag)
    if not tags:
        raise InvalidArgumentError(
            f"tag expression {expression!r} names no tag; use '*' or 'TagA || TagB'"
        )
    codes: list[int] = []
    seen_codes: set[int] = set()
    for tag in tags:
        code = java_string_hash(tag)
        if code not in seen_codes:
            seen_codes.add(code)
            codes.append(code)
    return SubscriptionData(topic, expression, tags, codes, sub_version=version)


def tag_matches(sub: SubscriptionData, tags: str | None) -> bool:
    """Client-side re-filter: does a message with these ``TAGS`` belong to ``sub``?

    Only subscriptions with an explicit tag list filter (not ``*``, not SQL92, not class
    filter mode); then the message's tag must be present and exactly one of the listed tags.
    """
    if not sub.tags_set or sub.class_filter_mode:
        return True
    return tags is not None and tags in sub.tags_set

"""A target for ``rmq-async run`` whose handler stops the app itself on a message ``stop``
(configured from ``NAMESRV_ADDR``, ``RMQ_TOPIC``, ``RMQ_GROUP``)."""

from __future__ import annotations

import os

from rmq_async import App, MessageExt, PushConsumer

consumer = PushConsumer(os.environ.get("RMQ_GROUP", "G_self_stop"),
                        namesrv=os.environ.get("NAMESRV_ADDR", "127.0.0.1:9876"),
                        consume_from_where="CONSUME_FROM_FIRST_OFFSET")
app = App(consumer)


@consumer.subscribe(os.environ.get("RMQ_TOPIC", "T_self_stop"))
async def on_message(msg: MessageExt) -> None:
    print(f"got {msg.body.decode()}", flush=True)
    if msg.body == b"stop":
        await app.stop()

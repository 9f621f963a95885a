"""A broker node's consumers (cluster/node.py): what a consumer leaves
unsettled comes back to the next one marked redelivered.

A real ``BrokerNode`` on the in-memory bus, Proton's blocking client in a
worker thread (the helpers of tests/cluster/test_node_durability.py)."""

from __future__ import annotations

from pathlib import Path

from tests.cluster.test_node_durability import (
    TIMEOUT_S,
    connect,
    declare,
    in_thread,
    journaled_broker,
    send,
)


async def test_a_message_sent_to_a_consumer_that_leaves_unsettled_comes_back_marked_redelivered(
    tmp_path: Path,
) -> None:
    # Found by tests/chaos (seed 2024): a consumer closed while the bus held
    # up its accepts; what it never settled went to the next consumer with a
    # delivery count of 0, which could not tell it might be a duplicate.
    async with journaled_broker(tmp_path / "journal") as (_node, port, _gate):
        await in_thread(lambda: declare(port, "q"))
        await in_thread(lambda: send(port, "q", "m", durable=False))

        def receive(*, accept: bool) -> tuple[str, int]:
            conn = connect(port)
            try:
                receiver = conn.create_receiver("q", credit=1)
                message = receiver.receive(timeout=TIMEOUT_S)
                if accept:
                    receiver.accept()
                return message.body, message.delivery_count
            finally:
                conn.close()

        assert await in_thread(lambda: receive(accept=False)) == ("m", 0)
        assert await in_thread(lambda: receive(accept=True)) == ("m", 1)

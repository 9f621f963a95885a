"""A Proton AMQP 1.0 client for the lab, tests and demo (Qpid Proton's own Container API).

Runs as a process so that it can be started inside a node's network
namespace (``ip netns exec``) as well as on loopback::

    python -m lab.client publish amqp://127.0.0.1:5672 orders --count 10000
    python -m lab.client consume amqp://127.0.0.1:5673 orders --count 10000
    python -m lab.client describe amqp://127.0.0.1:5672

Each prints one JSON object on stdout: ``publish`` the counts of accepted and
rejected messages (with the first rejection's text), ``consume`` the message
ids received in order, ``describe`` the broker's queues and digest.
Messages carry ids ``PREFIX-N`` (N from ``--start``) and the application
property ``seq``.  ``publish --rate R`` paces sending to R messages a second;
``publish --stamp`` adds the property ``sent_at`` (wall-clock seconds at
send), and ``consume`` then reports the lag (receive time minus ``sent_at``)
per message in ``lags`` (the lab's machines share one clock).  ``publish
--durable`` marks messages durable (persistent, for another broker).
``consume --raw`` reports each message's encoded bytes as received, in hex
(``payloads``), for byte-for-byte comparisons.
``publish --window N`` keeps at most N messages unsettled (in flight),
whatever credit the broker grants.  ``--record FILE`` (publish and consume)
appends one JSON line per settled publish (``{"id": ..., "outcome":
"accepted" | "rejected" | "released"}``) or per delivery (``{"id": ...,
"redelivered": bool, "accepted": bool}``; ``accepted`` false for a
message that arrived after the consumer closed, or with ``--hold``) as it
happens, so a client killed mid-run leaves what it saw (the chaos suite, tests/chaos, reads them).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import time
from typing import IO, Any

from proton import Delivery, Endpoint, Message
from proton.handlers import MessagingHandler
from proton.reactor import Container

# How often a paced publisher wakes to send what its rate allows by then.
PACE_TICK_S = 0.01


class Recorder:
    """``--record FILE``: one JSON line per outcome, flushed at once (a
    client killed -9 loses nothing it already saw); no file, no lines."""

    def __init__(self, path: str | None) -> None:
        self.file: IO[str] | None = open(path, "a") if path else None  # noqa: SIM115

    def write(self, **fields: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps(fields) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# Every client connects once (``reconnect=False``): Proton's default would
# retry a broker that is gone, on its old port, forever, and a lab client
# reports what it saw instead.


class Publisher(MessagingHandler):
    def __init__(
        self,
        url: str,
        address: str,
        count: int,
        prefix: str,
        start: int,
        size: int,
        subject: str | None,
        headers: dict[str, str],
        rate: float = 0.0,
        stamp: bool = False,
        durable: bool = False,
        window: int = 0,
        record: str | None = None,
    ) -> None:
        super().__init__()
        self.recorder = Recorder(record)
        self.url, self.address, self.count = url, address, count
        self.prefix, self.start, self.size = prefix, start, size
        self.subject, self.headers = subject, headers
        self.rate, self.stamp, self.durable = rate, stamp, durable
        self.window = window  # 0: as many in flight as the broker's credit allows
        self.began = 0.0
        self.sender: Any = None
        self.sent = 0
        self.accepted = 0
        self.rejected = 0
        self.released = 0
        self.first_error = ""
        self.error = ""
        self.tags: dict[Any, str] = {}  # delivery tag -> message id, for --record

    def on_start(self, event: Any) -> None:
        conn = event.container.connect(self.url, reconnect=False)
        self.sender = event.container.create_sender(conn, self.address)
        self.began = time.monotonic()
        if self.rate:
            event.container.schedule(PACE_TICK_S, self)

    def on_timer_task(self, event: Any) -> None:
        # Paced sending: top up to what the rate allows by now; a connection
        # that failed ends the pacing too (a pending timer keeps the
        # container running).
        if self.sent < self.count and self.sender is not None and not self.error:
            self._send(self.sender)
            event.container.schedule(PACE_TICK_S, self)

    def on_sendable(self, event: Any) -> None:
        self._send(event.sender)

    def _allowed(self) -> int:
        allowed = self.count
        if self.rate:
            allowed = min(allowed, int((time.monotonic() - self.began) * self.rate) + 1)
        if self.window:
            allowed = min(allowed, self.settled() + self.window)
        return allowed

    def _send(self, sender: Any) -> None:
        allowed = self._allowed()
        while sender.credit and self.sent < allowed:
            n = self.start + self.sent
            props: dict[str, Any] = {"seq": n, **self.headers}
            if self.stamp:
                props["sent_at"] = time.time()
            body = f"{self.prefix}-{n}".ljust(self.size, ".")
            delivery = sender.send(
                Message(
                    id=f"{self.prefix}-{n}",
                    body=body,
                    subject=self.subject,
                    properties=props,
                    durable=self.durable,
                )
            )
            self.tags[delivery.tag] = f"{self.prefix}-{n}"
            self.sent += 1

    def settled(self) -> int:
        return self.accepted + self.rejected + self.released

    def _record(self, event: Any, outcome: str) -> None:
        message_id = event.delivery.tag  # the tag Proton gave it at send: see _send
        self.recorder.write(id=self.tags.get(message_id, str(message_id)), outcome=outcome)

    def on_accepted(self, event: Any) -> None:
        self.accepted += 1
        self._record(event, "accepted")
        self._maybe_done(event)

    def on_released(self, event: Any) -> None:
        # Not taken (released or modified): the broker holds no copy.
        self.released += 1
        self._record(event, "released")
        self._maybe_done(event)

    def on_rejected(self, event: Any) -> None:
        self.rejected += 1
        self._record(event, "rejected")
        condition = event.delivery.remote.condition
        if not self.first_error and condition is not None:
            self.first_error = f"{condition.name}: {condition.description}"
        self._maybe_done(event)

    def _maybe_done(self, event: Any) -> None:
        if self.settled() >= self.count:
            event.connection.close()
        elif self.window:
            self._send(event.sender)  # a settlement opened the window

    def on_link_error(self, event: Any) -> None:
        condition = event.link.remote_condition
        self.error = f"{condition.name}: {condition.description}" if condition else "link error"
        event.connection.close()

    def on_transport_error(self, event: Any) -> None:
        condition = event.transport.condition
        self.error = (
            f"{condition.name}: {condition.description}" if condition else "transport error"
        )
        # The broker is gone: report what was settled, do not reconnect (a
        # publish in flight is the caller's to retry, as for any client).
        if event.connection is not None:
            event.connection.close()
        else:
            event.container.stop()

    def result(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "released": self.released,
            "first_rejection": self.first_error,
            "error": self.error,
        }


class Consumer(MessagingHandler):
    def __init__(
        self,
        url: str,
        address: str,
        count: int,
        idle_s: float,
        credit: int,
        hold: bool,
        record: str | None = None,
    ) -> None:
        # A holder grants its credit once and never tops it up, so it holds
        # exactly ``credit`` messages; a normal consumer keeps a prefetch window.
        super().__init__(prefetch=0 if hold else credit, auto_accept=False)
        self.url, self.address, self.count, self.idle_s = url, address, count, idle_s
        self.hold = hold
        self.credit = credit
        self.recorder = Recorder(record)
        self.ids: list[str] = []
        self.lags: list[float] = []
        self.first_at = 0.0
        self.last_at = 0.0
        self.redelivered = 0
        self.error = ""
        self.timer: Any = None
        self.conn: Any = None

    def on_start(self, event: Any) -> None:
        self.conn = event.container.connect(self.url, reconnect=False)
        receiver = event.container.create_receiver(self.conn, self.address)
        if self.hold:
            receiver.flow(self.credit)
        self._arm(event.container)

    def _arm(self, container: Any) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = container.schedule(self.idle_s, self)

    def on_timer_task(self, event: Any) -> None:
        # Nothing arrived for idle_s: we have what there is.
        if self.conn is not None:
            self.conn.close()

    def on_message(self, event: Any) -> None:
        if self.count and len(self.ids) >= self.count:
            # Prefetched beyond --count while closing: give it back.
            self.release(event.delivery, delivered=False)
            return
        redelivered = bool(event.message.delivery_count)
        if event.connection.state & Endpoint.LOCAL_CLOSED:
            # The broker sent it before it saw our close: it cannot be
            # accepted any more, so the broker releases it for another
            # consumer (marked redelivered).  Seen, not consumed.
            self.recorder.write(id=str(event.message.id), redelivered=redelivered, accepted=False)
            return
        if redelivered:
            self.redelivered += 1
        self.ids.append(str(event.message.id))
        self.recorder.write(
            id=str(event.message.id), redelivered=redelivered, accepted=not self.hold
        )
        self.last_at = time.time()
        self.first_at = self.first_at or self.last_at
        properties = event.message.properties or {}
        if "sent_at" in properties:
            self.lags.append(time.time() - float(properties["sent_at"]))
        if not self.hold:
            self.accept(event.delivery)
        self._arm(event.container)
        if self.count and len(self.ids) >= self.count:
            self.timer.cancel()
            event.connection.close()

    def on_link_error(self, event: Any) -> None:
        condition = event.link.remote_condition
        self.error = f"{condition.name}: {condition.description}" if condition else "link error"
        if self.timer is not None:
            self.timer.cancel()
        event.connection.close()

    def on_transport_error(self, event: Any) -> None:
        condition = event.transport.condition
        self.error = (
            f"{condition.name}: {condition.description}" if condition else "transport error"
        )
        if self.timer is not None:
            self.timer.cancel()

    def result(self) -> dict[str, Any]:
        return {
            "received": len(self.ids),
            "ids": self.ids,
            "lags": self.lags,
            "first_at": self.first_at,
            "last_at": self.last_at,
            "redelivered": self.redelivered,
            "error": self.error,
        }


class RawConsumer(Consumer):
    """``consume --raw``: each message's encoded bytes as they came off the
    wire (hex in ``payloads``), not decoded: what a test compares byte for
    byte with what was sent."""

    def __init__(self, url: str, address: str, count: int, idle_s: float, credit: int) -> None:
        super().__init__(url, address, count, idle_s, credit, hold=False)
        self.payloads: list[str] = []

    def on_delivery(self, event: Any) -> None:
        delivery = event.delivery
        if not delivery.readable or delivery.partial:
            return
        self.payloads.append(event.receiver.recv(delivery.pending).hex())
        self.ids.append(str(len(self.payloads)))
        delivery.update(Delivery.ACCEPTED)
        delivery.settle()
        self._arm(event.container)
        if self.count and len(self.payloads) >= self.count:
            self.timer.cancel()
            event.connection.close()

    def result(self) -> dict[str, Any]:
        return {**super().result(), "payloads": self.payloads}


class Describer(MessagingHandler):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.body: Any = None
        self.error = ""

    def on_start(self, event: Any) -> None:
        conn = event.container.connect(self.url, reconnect=False)
        event.container.create_receiver(conn, "$drgate.queues")

    def on_message(self, event: Any) -> None:
        self.body = json.loads(event.message.body)
        event.connection.close()

    def on_transport_error(self, event: Any) -> None:
        condition = event.transport.condition
        self.error = (
            f"{condition.name}: {condition.description}" if condition else "transport error"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.client", description=__doc__)
    sub = parser.add_subparsers(dest="op", required=True)
    pub = sub.add_parser("publish")
    pub.add_argument("url")
    pub.add_argument("address")
    pub.add_argument("--count", type=int, default=1)
    pub.add_argument("--prefix", default="m")
    pub.add_argument("--start", type=int, default=1)
    pub.add_argument("--size", type=int, default=0, help="pad bodies to this many characters")
    pub.add_argument("--subject", default=None, help="routing key when sending to an exchange")
    pub.add_argument("--header", action="append", default=[], metavar="K=V")
    pub.add_argument("--rate", type=float, default=0.0, help="messages a second (0: unpaced)")
    pub.add_argument("--stamp", action="store_true", help="add the property sent_at")
    pub.add_argument("--durable", action="store_true", help="mark messages durable (persistent)")
    pub.add_argument(
        "--window", type=int, default=0, help="at most this many unsettled (0: the broker's credit)"
    )
    con = sub.add_parser("consume")
    con.add_argument("url")
    con.add_argument("address")
    con.add_argument("--count", type=int, default=0, help="stop after this many (0: until idle)")
    con.add_argument(
        "--idle", type=float, default=3.0, help="stop after this long without a message"
    )
    con.add_argument("--credit", type=int, default=100)
    con.add_argument("--hold", action="store_true", help="never settle: keep what arrives acquired")
    con.add_argument(
        "--raw", action="store_true", help="report each message's bytes as received (payloads)"
    )
    for command in (pub, con):
        command.add_argument("--record", default=None, help="append one JSON line per outcome")
    des = sub.add_parser("describe")
    des.add_argument("url")
    args = parser.parse_args(argv)
    # SIGUSR1 prints every thread's stack on stderr: why a client is stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    handler: Any
    if args.op == "publish":
        headers = dict(h.split("=", 1) for h in args.header)
        handler = Publisher(
            args.url,
            args.address,
            args.count,
            args.prefix,
            args.start,
            args.size,
            args.subject,
            headers,
            args.rate,
            args.stamp,
            args.durable,
            args.window,
            args.record,
        )
    elif args.op == "consume" and args.raw:
        handler = RawConsumer(args.url, args.address, args.count, args.idle, args.credit)
    elif args.op == "consume":
        handler = Consumer(
            args.url, args.address, args.count, args.idle, args.credit, args.hold, args.record
        )
    else:
        handler = Describer(args.url)
    Container(handler).run()
    result = (
        handler.result()
        if hasattr(handler, "result")
        else {"describe": handler.body, "error": handler.error}
    )
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0 if not result.get("error") else 2


if __name__ == "__main__":
    sys.exit(main())

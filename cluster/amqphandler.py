"""The contract between the AMQP 1.0 listener (cluster/amqp.py) and the
broker node (cluster/node.py): the callbacks the listener awaits, one
connection's events in order.  Re-exported by :mod:`cluster.amqp`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cluster.amqp import AmqpConnection, InboundDelivery, IncomingLink, OutgoingLink
    from cluster.amqpvalues import Outcome

__all__ = ["AmqpHandler"]


class AmqpHandler(Protocol):
    """What the broker node implements.  Every callback is awaited by the
    connection's pump before the next event of that connection is processed,
    so a callback that waits slows that client down (backpressure) and the
    order of one connection's events is kept.

    A callback that raises closes that connection with ``amqp:internal-error``
    (logged with its traceback); it never takes the server down.
    """

    async def on_sender_link(self, link: OutgoingLink) -> None:
        """A client attached a link to RECEIVE from ``link.address``.

        Return to accept it (the attach is answered when the callback
        returns), or call ``link.close(condition, description)`` first to
        refuse it.  For a dynamic source call ``link.set_address(...)``.
        """
        ...

    async def on_receiver_link(self, link: IncomingLink) -> None:
        """A client attached a link to SEND to ``link.address`` (``None``: the
        anonymous relay, each message names its ``address``; for a dynamic
        target call ``link.set_address(...)``).  Grant credit with
        ``link.flow(n)``, or refuse with ``link.close(...)``."""
        ...

    async def on_message(self, link: IncomingLink, delivery: InboundDelivery) -> None:
        """A whole message arrived on ``link``.  Settle it now or later with
        ``delivery.settle(outcome)``.  Each message used one credit."""
        ...

    async def on_credit(self, link: OutgoingLink, credit: int) -> None:
        """The client changed the credit of ``link`` (``credit`` is the total
        now available; ``link.drain`` says whether it asks for a drain)."""
        ...

    async def on_outcomes(
        self, link: OutgoingLink, outcomes: Sequence[tuple[object, Outcome]]
    ) -> None:
        """The client settled the messages sent with these tokens, in this
        order: every settlement on ``link`` that arrived together (one read
        from the socket), so that the node can act on them as one."""
        ...

    async def on_close_asked(self, conn: AmqpConnection) -> None:
        """The client asked to close ``conn``, one of its sessions or one of
        its links.  The close is answered when this returns (or after
        :data:`cluster.amqp.CLOSE_SETTLE_WAIT_S`): a client whose close was answered
        knows that the broker acted on every settlement it sent before."""
        ...

    async def on_link_closed(self, link: OutgoingLink | IncomingLink) -> None:
        """``link`` ended (detach, session end, connection end, or our own
        ``close``).  Called exactly once for every link handed to
        ``on_sender_link`` / ``on_receiver_link``.  Tokens still in
        ``link.unsettled_tokens()`` got no outcome: release them."""
        ...

    async def on_connection_closed(self, conn: AmqpConnection) -> None:
        """The connection ended, cleanly or not.  Called exactly once per
        connection, after ``on_link_closed`` for each of its links."""
        ...

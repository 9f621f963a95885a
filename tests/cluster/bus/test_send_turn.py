"""The corosync member's send turn: FIFO, no overtaking, cancellation-safe.

A member's own messages must reach the bus in the order ``multicast`` was
called (and the chunks of a large payload together), so the turn is handed
straight to the longest waiter; a newcomer must never take it in between.
"""

from __future__ import annotations

import trio
import trio.testing

from cluster.bus.corosync import _SendTurn


async def test_waiters_get_the_turn_in_arrival_order_and_newcomers_wait() -> None:
    turn = _SendTurn()
    order: list[str] = []

    async def sender(name: str) -> None:
        await turn.acquire()
        order.append(name)
        await trio.sleep(0.01)  # hold the turn across a checkpoint
        turn.release()

    async with trio.open_nursery() as nursery:
        for name in "abc":
            nursery.start_soon(sender, name)
            await trio.testing.wait_all_tasks_blocked()
        # Released by "a" while "b" and "c" wait: a newcomer must not overtake.
        await trio.sleep(0.01)
        nursery.start_soon(sender, "d")
    assert order == ["a", "b", "c", "d"]


async def test_a_cancelled_waiter_leaves_the_queue_and_the_turn_moves_on() -> None:
    turn = _SendTurn()
    await turn.acquire()
    got: list[str] = []

    async def waiter(name: str) -> None:
        await turn.acquire()
        got.append(name)
        turn.release()

    first = trio.CancelScope()

    async def cancellable_waiter() -> None:
        with first:
            await waiter("x")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancellable_waiter)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, "y")
        await trio.testing.wait_all_tasks_blocked()
        first.cancel()  # "x" gives up waiting; "y" is next
        await trio.testing.wait_all_tasks_blocked()
        turn.release()
    assert got == ["y"]
    await turn.acquire()  # free again
    turn.release()


async def test_the_releaser_cannot_take_the_turn_back_before_the_woken_waiter() -> None:
    turn = _SendTurn()
    order: list[str] = []
    await turn.acquire()

    async def waiter() -> None:
        await turn.acquire()
        order.append("waiter")
        turn.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        turn.release()  # handed to the waiter, which has not run yet
        await turn.acquire()  # no checkpoint in between: must queue behind it
        order.append("releaser")
        turn.release()
    assert order == ["waiter", "releaser"]

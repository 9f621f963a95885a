"""gateway/ackgate: acks held until D's durable watermark covers them, batched,
released on the watermark's signal (no polling), at once without journals."""

from __future__ import annotations

import trio
import trio.testing

from gateway.ackgate import AckGate, DurableWatermark


async def test_without_journals_every_applied_seq_is_acked_at_once() -> None:
    acked: list[int] = []
    gate = AckGate(DurableWatermark(None), acked.append)
    gate.applied(3, 40)
    gate.applied(5, 41)
    assert acked == [3, 5]
    assert gate.held == 0


async def test_held_acks_go_as_one_once_the_watermark_covers_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    durable = [0]
    watermark = DurableWatermark(lambda: durable[0])
    acked: list[int] = []
    gate = AckGate(watermark, acked.append)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.serve)
        for seq, cseq in ((1, 10), (2, 11), (3, 12), (4, 13)):
            gate.applied(seq, cseq)
        await trio.sleep(60)
        assert (acked, gate.held) == ([], 4)
        durable[0] = 12  # covers seqs 1 to 3: one ack for them
        watermark.advanced()
        await trio.sleep(1)
        assert (acked, gate.held) == ([3], 1)
        durable[0] = 20
        await trio.sleep(60)
        assert acked == [3]  # nobody said the watermark moved: nothing polls it
        watermark.advanced()
        await trio.sleep(1)
        assert (acked, gate.held) == ([3, 4], 0)
        gate.applied(5, 19)  # already durable, nothing held: at once
        assert acked == [3, 4, 5]
        gate.applied(6, 21)
        gate.applied(7, 22)
        assert (acked, gate.held) == ([3, 4, 5], 2)
        nursery.cancel_scope.cancel()

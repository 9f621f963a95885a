"""A small mutation fuzzer for the decoders' fuzz tests (tests/fuzz/).

Start from valid encodings, damage them (:class:`Mutator`: bit flips,
interesting bytes, truncation, extension, splices, deleted and repeated runs,
integer fields set to huge values), let the format's own ``fix`` re-compute
its CRC so the damage reaches the parser, decode, and accept only the typed
errors the decoder promises (:func:`fuzz`).

The decoders' property tests (tests/protocol, tests/filters) use the same
mutations under Hypothesis (:func:`mutated`: the draws are Hypothesis's, so a
failure shrinks) and count with :class:`Reach` how many examples got past the
framing checks to a record: random bytes almost never do.

Deterministic: iteration ``i`` draws from ``random.Random(f"{seed}:{i}")``,
so a failure names the seed and iteration that reproduce it.  CI runs a
fixed, small number of iterations per decoder (the ``default`` each test
passes); ``DRGATE_FUZZ_ITERATIONS=200000`` (``make fuzz``) runs longer and
``DRGATE_FUZZ_SEED`` picks another seed.
"""

from __future__ import annotations

import os
import random
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hypothesis import Phase, event, settings
from hypothesis import strategies as st

ITERATIONS_ENV = "DRGATE_FUZZ_ITERATIONS"
SEED_ENV = "DRGATE_FUZZ_SEED"
DEFAULT_SEED = 20240617

# Values a length or count field is most likely to be mishandled at.
INTERESTING = (
    0,
    1,
    0x7F,
    0x80,
    0xFF,
    0x100,
    0x7FFF,
    0x8000,
    0xFFFF,
    0x10000,
    0x7FFFFFFF,
    0x80000000,
    0xFFFFFFFF,
    0x7FFFFFFFFFFFFFFF,
    0xFFFFFFFFFFFFFFFF,
)


def iterations(default: int) -> int:
    """``default``, or the iteration count ``DRGATE_FUZZ_ITERATIONS`` asks for."""
    value = os.environ.get(ITERATIONS_ENV, "")
    return int(value) if value else default


def seed() -> int:
    value = os.environ.get(SEED_ENV, "")
    return int(value) if value else DEFAULT_SEED


class Mutator:
    """Damages byte strings; ``corpus`` gives the splices their material."""

    def __init__(self, rng: random.Random, corpus: Sequence[bytes] = ()) -> None:
        self.rng = rng
        self.corpus = [c for c in corpus if c] or [b"\x00"]

    def mutate(
        self, data: bytes, *, fields: Sequence[tuple[int, int]] = (), rounds: int = 3
    ) -> bytes:
        """``data`` with 1..``rounds`` mutations.  ``fields`` lists ``(offset,
        width)`` of known length or count fields, set to huge values more often."""
        buf = bytearray(data)
        for _ in range(self.rng.randint(1, rounds)):
            self.rng.choice(self._OPS)(self, buf, fields)
        return bytes(buf)

    # -- the mutations -------------------------------------------------------

    def _pos(self, buf: bytearray) -> int:
        return self.rng.randrange(len(buf) + 1)

    def flip_bits(self, buf: bytearray, _fields: Sequence[tuple[int, int]]) -> None:
        for _ in range(self.rng.choice((1, 1, 2, 4))):
            if buf:
                buf[self.rng.randrange(len(buf))] ^= 1 << self.rng.randrange(8)

    def set_byte(self, buf: bytearray, _fields: Sequence[tuple[int, int]]) -> None:
        if buf:
            buf[self.rng.randrange(len(buf))] = self.rng.choice((0, 1, 0x7F, 0x80, 0xFE, 0xFF))

    def truncate(self, buf: bytearray, _fields: Sequence[tuple[int, int]]) -> None:
        del buf[self._pos(buf) :]

    def extend(self, buf: bytearray, _fields: Sequence[tuple[int, int]]) -> None:
        n = self.rng.choice((1, 2, 4, 8, 64))
        buf += self.rng.choice((bytes(n), b"\xff" * n, self.rng.randbytes(n)))

    def splice(self, buf: bytearray, _fields: Sequence[tuple[int, int]]) -> None:
        other = self.rng.choice(self.corpus)
        start = self.rng.randrange(len(other))
        piece = other[start : start + self.rng.randint(1, 64)]
        at = self._pos(buf)
        if self.rng.random() < 0.5:
            buf[at:at] = piece
        else:
            buf[at : at + len(piece)] = piece

    def delete(self, buf: bytearray, _fields: Sequence[tuple[int, int]]) -> None:
        at = self._pos(buf)
        del buf[at : at + self.rng.choice((1, 2, 4, 8, 16))]

    def repeat(self, buf: bytearray, _fields: Sequence[tuple[int, int]]) -> None:
        at = self._pos(buf)
        run = buf[at : at + self.rng.choice((1, 4, 16, 64))]
        buf[at:at] = run * self.rng.randint(1, 3)

    def big_field(self, buf: bytearray, fields: Sequence[tuple[int, int]]) -> None:
        if fields and self.rng.random() < 0.7:
            at, width = self.rng.choice(fields)
        else:
            at, width = self._pos(buf), self.rng.choice((1, 2, 4, 8))
        if at + width > len(buf):
            return
        limit = (1 << (8 * width)) - 1
        value = self.rng.choice((*INTERESTING, len(buf), len(buf) + 1, len(buf) - at))
        if self.rng.random() < 0.3:
            value = self.rng.randint(0, limit)
        buf[at : at + width] = (value & limit).to_bytes(width, "big")

    _OPS: tuple[Callable[[Mutator, bytearray, Sequence[tuple[int, int]]], None], ...] = (
        flip_bits,
        flip_bits,
        set_byte,
        truncate,
        extend,
        splice,
        delete,
        repeat,
        big_field,
        big_field,
    )


@dataclass
class FuzzResult:
    """How the inputs of a run ended: ``"ok"`` or the error's label, counted."""

    outcomes: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())

    def share(self, label: str) -> float:
        return self.outcomes[label] / max(self.total, 1)


def label_of(exc: BaseException) -> str:
    """``TypeName`` or, for an error that carries one, ``TypeName:code``."""
    code = getattr(exc, "code", None)
    return type(exc).__name__ if code is None else f"{type(exc).__name__}:{code}"


def fuzz(
    name: str,
    seeds: Sequence[bytes],
    decode: Callable[[bytes], object],
    *,
    allowed: type[BaseException] | tuple[type[BaseException], ...],
    default_iterations: int,
    make_input: Callable[[Mutator, bytes], bytes] | None = None,
    label: Callable[[BaseException], str] = label_of,
) -> FuzzResult:
    """Decode ``default_iterations`` (or ``DRGATE_FUZZ_ITERATIONS``) damaged
    inputs; fail on the first exception that is not ``allowed``, naming the
    seed, the iteration and the input.

    ``make_input(mutator, seed_bytes)`` builds one input (default: mutate the
    seed); formats with a checksum pass one that re-computes it.
    """
    base = seed()
    result = FuzzResult()
    build = make_input or (lambda m, data: m.mutate(data))
    for i in range(iterations(default_iterations)):
        rng = random.Random(f"{base}:{name}:{i}")
        mutator = Mutator(rng, seeds)
        data = build(mutator, rng.choice(seeds))
        try:
            decode(data)
        except allowed as exc:
            result.outcomes[label(exc)] += 1
        except Exception as exc:  # any other error is the finding
            shown = data[:512].hex()
            raise AssertionError(
                f"{name}: seed {base} iteration {i}: {type(exc).__name__}: {exc}\n"
                f"input ({len(data)} bytes): {shown}{'...' if len(data) > 512 else ''}\n"
                f"{''.join(traceback.format_exception(exc))}"
            ) from exc
        else:
            result.outcomes["ok"] += 1
    return result


def mutated(
    draw: st.DrawFn, data: bytes, *, fields: Sequence[tuple[int, int]] = (), rounds: int = 3
) -> bytes:
    """Inside a ``@st.composite``: ``data`` with 1..``rounds`` of the
    :class:`Mutator`'s mutations, from a ``random.Random`` Hypothesis seeds
    (its own draws would favour the first mutation and the smallest values)."""
    rng = draw(st.randoms(use_true_random=True))
    return Mutator(rng, [data]).mutate(data, fields=fields, rounds=rounds)


# The mutation fuzzers' inputs are derived from many draws and do not shrink to
# anything smaller to read: a failure prints the input as found, at once,
# rather than after minutes of shrinking.
NO_SHRINK = settings(phases=[Phase.explicit, Phase.reuse, Phase.generate])


@dataclass
class Reach:
    """How many of a property test's examples reached a decoder's inner
    paths (a record, past the length, magic and checksum checks).  ``note``
    each example inside the ``@given`` function; ``check`` after it ran prints
    the share and fails below ``floor``."""

    decoder: str
    examples: int = 0
    reached: int = 0

    def note(self, reached: bool) -> None:
        self.examples += 1
        self.reached += reached
        event(f"{self.decoder}: {'reached a record' if reached else 'stopped before one'}")

    @property
    def share(self) -> float:
        return self.reached / max(self.examples, 1)

    def check(self, floor: float = 0.5) -> None:
        print(
            f"reach {self.decoder}: {self.reached} of {self.examples} examples ({self.share:.0%})"
        )
        assert self.examples > 0
        assert self.share > floor, (
            f"{self.decoder}: only {self.reached} of {self.examples} examples reached a record"
        )

"""bench/ab.py reads bench/e2e_bench.py's tables, and nothing else, cell by cell."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import ab

RUN = """\
CPU at 500 msgs/s offered, 3 node(s) per site ...

process role (µs CPU / message delivered at D)            500/s offered            1000/s offered
P broker receiving the publishes                          100 / 313 each            152 / 153 each
all processes                                                       2840                      1542
of which in the kernel (system time)                                 11%                       10%
lag p50 / p99 (ms)                                           31 /   44               36 /   45
profile burst, 3 node(s) per site (py-spy) ...                   starting                      now
"""


def test_every_cell_of_a_table_is_read_under_its_row_and_column() -> None:
    cells = ab.parse_tables(RUN)
    assert cells == {
        ("P broker receiving the publishes", "500/s offered"): "100 / 313 each",
        ("P broker receiving the publishes", "1000/s offered"): "152 / 153 each",
        ("all processes", "500/s offered"): "2840",
        ("all processes", "1000/s offered"): "1542",
        ("of which in the kernel (system time)", "500/s offered"): "11%",
        ("of which in the kernel (system time)", "1000/s offered"): "10%",
        ("lag p50 / p99 (ms)", "500/s offered"): "31 / 44",
        ("lag p50 / p99 (ms)", "1000/s offered"): "36 / 45",
    }


def test_rounds_of_both_trees_stand_side_by_side_per_column() -> None:
    base = [ab.parse_tables(RUN), ab.parse_tables(RUN.replace("2840", "2900"))]
    head = [ab.parse_tables(RUN.replace("2840", "2500"))]
    text = ab.side_by_side(base, head)
    assert "500/s offered: BASE rounds | this tree's rounds" in text
    assert "2840; 2900  |  2500" in text
    assert "1542; 1542  |  1542" in text

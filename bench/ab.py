"""Two commits side by side: ``bench/e2e_bench.py`` alternating between them.

    .venv/bin/python bench/ab.py BASE [--rounds 3] -- --cpu-paced 500,1000 --step 6 --cpu-nodes 3
    make bench-ab BASE=HEAD~1 ROUNDS=3 ARGS="--cpu-only --cpu-nodes 3"

On this machine a single run of a paced load or a burst spreads by 10 % and
more (17 processes and the clients share two cores), so a change is judged
against the commit before it in the same sitting, alternating: BASE, this
tree, BASE, this tree, ...  BASE is checked out in a work tree of its own
(``git worktree add --detach``, removed at the end, also after a failure or
Ctrl-C); each run is ``bench/e2e_bench.py ARGS`` started from its tree with
this tree's interpreter, under the lock the corosync tests and ``make chaos``
take (``/tmp/drgate-corosync.lock``), so that none of them shares the cores
with it; a run that has to wait for the lock says so (run under ``flock`` on
the same lock, it would wait for itself).  Uncommitted changes here are
measured as they are; BASE is what git has.

What it prints: for every table row the runs print (the µs of CPU per
message of each process role, all processes, delivered/s, the cores busy,
the lag) and every column (a load, a site size), each round's cell for BASE
and for this tree, side by side.  Reading them is left to the reader: a
change that does not separate the two sets of rounds has not been shown.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
LOCK = Path("/tmp/drgate-corosync.lock")
# bench/e2e_bench.py's tables: a label of 46 characters, then cells of 26.
LABEL_WIDTH = 46
CELL_WIDTH = 26
# A table starts at the line whose label begins so.
HEADER = "process role"


Cells = dict[tuple[str, str], str]
"""One run's table cells: (row, column) -> text."""


# A row's cells are figures: digits, separators, "%", "each", "—".
FIGURES = re.compile(r"^[\d.,/ %—]*( each)?$")


def parse_tables(output: str) -> Cells:
    """Every cell of the tables in one run's output: (row, column) -> text.
    A table is its header line and the rows after it, up to the first line
    that is not a row of figures (a blank line, the next step's progress)."""
    cells: Cells = {}
    columns: list[str] = []
    for line in output.splitlines():
        if line.startswith(HEADER):
            columns = _cells(line)
            continue
        row, texts = line[:LABEL_WIDTH].strip(), _cells(line)
        if not columns or not row or not texts or not all(FIGURES.match(t) for t in texts):
            columns = []
            continue
        for column, text in zip(columns, texts, strict=False):
            cells[(row, column)] = text
    return cells


def _cells(line: str) -> list[str]:
    """The cells after the label, each with its inner spaces made one."""
    rest = line[LABEL_WIDTH:]
    return [
        " ".join(rest[i : i + CELL_WIDTH].split())
        for i in range(0, len(rest), CELL_WIDTH)
        if rest[i:].strip()
    ]


def side_by_side(base: list[Cells], head: list[Cells]) -> str:
    """The cells of every round, BASE's then this tree's, by column and row."""
    keys: list[tuple[str, str]] = []
    for run in base + head:
        keys += [k for k in run if k not in keys]
    lines: list[str] = []
    for column in dict.fromkeys(c for _, c in keys):
        lines += ["", f"{column}: BASE rounds | this tree's rounds"]
        for row in dict.fromkeys(r for r, c in keys if c == column):
            left = "; ".join(run.get((row, column), "—") for run in base)
            right = "; ".join(run.get((row, column), "—") for run in head)
            if not (left + right).strip("—; "):
                continue  # no such process in either (a role the site size lacks)
            lines.append(f"  {row:<{LABEL_WIDTH - 2}} {left}  |  {right}")
    return "\n".join(lines)


@contextlib.contextmanager
def work_tree(rev: str) -> Iterator[Path]:
    """``rev`` checked out in a temporary work tree, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="drgate-ab-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(HERE), "worktree", "add", "--detach", "--quiet", str(tree), rev],
            check=True,
        )
        try:
            yield tree
        finally:
            subprocess.run(
                ["git", "-C", str(HERE), "worktree", "remove", "--force", str(tree)], check=False
            )


def run(tree: Path, args: list[str]) -> str:
    """One run of the bench from ``tree``, under the lock; its output."""
    with LOCK.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"  waiting for {LOCK}: a corosync test, make chaos or another bench holds "
                "it (under `flock` on the same lock, make bench-ab waits for itself)",
                flush=True,
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(
            [sys.executable, "bench/e2e_bench.py", *args],
            cwd=tree,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"bench/e2e_bench.py failed in {tree}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s BASE [--rounds N] -- ARGS..."
    )
    parser.add_argument("base", help="the commit to compare this tree with (e.g. HEAD~1)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each (default 3)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ns, args = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    if not args:
        parser.error("name bench/e2e_bench.py's arguments after --, e.g. -- --cpu-paced 500,1000")
    base: list[Cells] = []
    head: list[Cells] = []
    with work_tree(ns.base) as tree:
        for i in range(1, ns.rounds + 1):
            for name, where, runs in (("BASE", tree, base), ("this tree", HERE, head)):
                print(f"round {i} of {ns.rounds}: {name} ...", flush=True)
                runs.append(parse_tables(run(where, args)))
    print(side_by_side(base, head))


if __name__ == "__main__":
    main()

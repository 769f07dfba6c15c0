"""The README's benchmark tables, regenerated from one ``python -m bench`` run.

Every table of figures in README.md sits between two markers, ``<!-- bench: PART -->`` and
``<!-- end of bench: PART -->``, PART one of ``BLOCKS`` (the parts of ``python -m bench``). What is
between them is made here, never typed: a line that says which run it comes from (date, CPU, cores,
load average, ``--quick``), then the part's own report of that run's JSON (the text it printed), in a
code block. So a table and the run it claims to be from cannot drift apart, and regenerating the
README after a run is one command::

    python -m bench --readme                           # run every part, then rewrite the blocks
    python -m bench.readme bench/results/bench-X.json  # rewrite them from a saved run

A later run of some parts replaces those and leaves the others with the run they name (``merged``); a
part never recorded says so in its block. The prose
around a block says what the table shows and why, and quotes no figure of it (figures quoted beside a
table are the ones that went stale). ``tests/test_bench_readme.py`` checks the markers.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The run the README's blocks come from, kept (strictly JSON: NaN as null) so that a test can render them
# again from it and find any table typed over by hand, or a report function that no longer reads it.
RUN = ROOT / "docs" / "bench-run.json"

# Block name -> (module, its report function of a run's result dict -> the text it prints).
BLOCKS = {
    "engine": ("bench.engine_bench", "format_table"),
    "engine-avx2": ("bench.engine_bench", "format_table"),
    "int8-range": ("bench.int8_range_bench", "report"),
    "preprocess": ("bench.preprocess_bench", "report"),
    "e2e": ("bench.e2e_bench", "report"),
    "ready": ("bench.ready_bench", "report"),
    "page": ("bench.page_bench", "report"),
    "overload": ("bench.overload_bench", "report"),
    "fidelity": ("bench.fidelity_bench", "format_table"),
    "int8": ("bench.int8_bench", "report"),
}
_MARK = re.compile(r"^(?P<indent>[ \t]*)<!-- bench: (?P<name>[\w-]+) -->[ \t]*$", re.M)


def _end(name: str) -> str:
    return f"<!-- end of bench: {name} -->"


def provenance(run: dict) -> str:
    """One line naming the run a block comes from: when, on what CPU, how busy, quick or not."""
    machine = run.get("machine") or {}
    bits = [f"`python -m bench{' --quick' if run.get('quick') else ''}`, {run.get('date', '?')}"]
    if machine.get("cpu"):
        bits.append(f"{machine['cpu']} ({machine.get('isa', '?')}), {machine.get('cores', '?')} cores")
    if machine.get("load_avg") is not None:
        bits.append(f"load average {machine['load_avg']:.1f} at start")
    return "From " + ", ".join(bits) + ":"


def render(name: str, result: dict, run: dict) -> str:
    """The text of block ``name`` (without its markers) for a part's ``result``, from ``run`` (or the run
    recorded in the result as ``_run``, see ``merged``).

    :raises KeyError: ``name`` is not one of ``BLOCKS``."""
    module, fn = BLOCKS[name]
    text = getattr(importlib.import_module(module), fn)(result)
    return "\n".join([provenance(result.get("_run") or run), "", "```", text.strip("\n"), "```"])


def pending(name: str) -> str:
    """The text of block ``name`` while no recorded run has that part: says so and how to fill it."""
    return (f"(No run of the part `{name}` is recorded yet: `python -m bench --only {name} --readme` measures it and "
            "fills this in.)")


def _end_at(text: str, name: str, pos: int):
    """The end marker of block ``name`` on a line of its own after ``pos``, or None."""
    return re.compile(rf"^[ \t]*{re.escape(_end(name))}[ \t]*$", re.M).search(text, pos)


def blocks_in(text: str) -> list[str]:
    """The block names marked in ``text``, in order.

    :raises ValueError: a block without its end marker after it, or a name marked twice."""
    marks = list(_MARK.finditer(text))
    names = [m["name"] for m in marks]
    for m in marks:
        if names.count(m["name"]) > 1:
            raise ValueError(f"bench block {m['name']!r} is marked {names.count(m['name'])} times")
        if _end_at(text, m["name"], m.end()) is None:
            raise ValueError(f"bench block {m['name']!r} has no end marker ({_end(m['name'])}) after it")
    return names


def update(text: str, run: dict, *, renderer=render) -> tuple[str, list[str]]:
    """``text`` (the README) with every marked block rewritten from ``run``; and the names of those it had.

    ``run`` is what ``merged`` makes: every part ever recorded, each with the run it came from, so a
    block whose part is absent has never been measured and says so (``pending``). A block keeps its
    marker's indentation (a table inside a list item stays inside it).

    :raises ValueError: malformed markers (``blocks_in``)."""
    done = []
    for name in blocks_in(text):
        result = run.get(name)
        m = next(x for x in _MARK.finditer(text) if x["name"] == name)
        end = _end_at(text, name, m.end())
        made = renderer(name, result, run) if isinstance(result, dict) else pending(name)
        body = "\n".join((m["indent"] + line).rstrip() for line in made.splitlines())
        text = text[:m.end()] + "\n" + body + "\n" + m["indent"] + _end(name) + text[end.end():]
        if isinstance(result, dict):
            done.append(name)
    return text, done


def merged(run: dict, kept: dict) -> dict:
    """``kept`` (the run the README's blocks came from) with the parts of ``run`` in place of its own.

    Each part keeps the date, machine and ``quick`` of the run it came from (``_run``), so a block rewritten
    from a later run names that run and the blocks left alone still name theirs."""
    out = {k: v for k, v in kept.items() if isinstance(v, dict) and k in BLOCKS}
    stamp = {k: run.get(k) for k in ("date", "quick", "machine")}
    for name in BLOCKS:
        part = run.get(name)
        if isinstance(part, dict):  # a part re-read from a kept file keeps the run it came from
            out[name] = {**part, "_run": part.get("_run") or stamp}
    return out


def write(run: dict, readme: Path = README, kept: Path = RUN, *, renderer=render) -> list[str]:
    """Rewrite ``readme``'s blocks from ``run`` (a ``python -m bench`` JSON) and record the parts in ``kept``;
    returns the names rewritten."""
    from bench import clean

    previous = json.loads(kept.read_text()) if kept.is_file() else {}
    both = json.loads(json.dumps(clean(merged(run, previous))))  # rendered from exactly what is kept
    text, done = update(readme.read_text(encoding="utf-8"), both, renderer=renderer)
    readme.write_text(text, encoding="utf-8")
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(both, indent=1) + "\n")  # key order kept: the reports list rows in it
    return done


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.readme RUN.json [--readme README.md]``: rewrite the blocks; 0, or 1 if none was in the run."""
    parser = argparse.ArgumentParser(prog="python -m bench.readme", description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a JSON file written by python -m bench")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    done = write(json.loads(args.run.read_text()), args.readme)
    print(f"rewrote {len(done)} block(s) of {args.readme}: {', '.join(done) or 'none'}")
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())

"""bench/readme.py: the README's benchmark tables are the parts' own reports of one recorded run."""

from __future__ import annotations

import json

import pytest

from bench import readme
from bench.__main__ import PARTS


def fake(name, result, run):
    return f"{name}: {result['x']} ({readme.provenance(result.get('_run') or run)})\nsecond line"


TEXT = """# Title

<!-- bench: engine -->
old engine table
<!-- end of bench: engine -->

- a list item:

  <!-- bench: fidelity -->
  old fidelity table
  <!-- end of bench: fidelity -->

prose after
"""


def test_update_rewrites_only_the_blocks_of_the_run_keeping_their_indentation():
    run = {"date": "2026-12-01 19:00 UTC", "quick": True, "fidelity": {"x": 7}}
    text, done = readme.update(TEXT, run, renderer=fake)
    assert done == ["fidelity"]
    assert "old engine table" not in text and "old fidelity table" not in text
    assert f"<!-- bench: engine -->\n{readme.pending('engine')}\n<!-- end of bench: engine -->" in text  # never run
    assert ("  <!-- bench: fidelity -->\n  fidelity: 7 (From `python -m bench --quick`, 2026-12-01 19:00 UTC:)\n"
            "  second line\n  <!-- end of bench: fidelity -->\n\nprose after\n") in text
    assert readme.update(text, run, renderer=fake)[0] == text  # the same run again: the same README


def test_malformed_markers_are_refused():
    with pytest.raises(ValueError, match="no end marker"):
        readme.blocks_in("<!-- bench: engine -->\nno end\n")
    with pytest.raises(ValueError, match="marked 2 times"):
        readme.blocks_in(TEXT + TEXT)


def test_a_later_run_replaces_its_parts_and_the_others_keep_the_run_they_name(tmp_path):
    md, kept = tmp_path / "README.md", tmp_path / "run.json"
    md.write_text(TEXT)
    first = {"date": "D1", "quick": False, "engine": {"x": 1}, "fidelity": {"x": 2, "nan": float("nan")}}
    assert readme.write(first, md, kept, renderer=fake) == ["engine", "fidelity"]
    assert readme.write({"date": "D2", "quick": True, "fidelity": {"x": 3}}, md, kept, renderer=fake) == ["engine", "fidelity"]
    text = md.read_text()
    assert "engine: 1 (From `python -m bench`, D1:)" in text
    assert "fidelity: 3 (From `python -m bench --quick`, D2:)" in text
    rec = json.loads(kept.read_text())
    assert rec["engine"]["_run"]["date"] == "D1" and rec["fidelity"]["_run"]["date"] == "D2"
    # Rewritten from the kept file itself (python -m bench.readme docs/bench-run.json): nothing changes.
    assert readme.write(rec, md, kept, renderer=fake) == ["engine", "fidelity"]
    assert md.read_text() == text and json.loads(kept.read_text()) == rec


def test_every_part_has_its_block_in_the_readme_and_every_block_a_part():
    names = readme.blocks_in(readme.README.read_text(encoding="utf-8"))
    assert set(readme.BLOCKS) <= set(PARTS)
    assert sorted(names) == sorted(readme.BLOCKS)


def test_the_readme_tables_are_the_reports_of_the_recorded_run():
    """Typed over by hand, or a report function that no longer reads the recorded run: this fails."""
    run = json.loads(readme.RUN.read_text())
    text = readme.README.read_text(encoding="utf-8")
    again, done = readme.update(text, run)
    assert done and set(done) <= set(readme.BLOCKS)
    assert again == text  # the recorded parts as their reports, the others saying they are not measured yet

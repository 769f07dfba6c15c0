"""The README promises what the code does: its settings table and its test command."""

import re

from conftest import ROOT
from webapp import settings

README = (ROOT / "README.md").read_text()


def test_readme_settings_table_is_generated_from_the_table():
    start = README.index("<!-- settings table")
    block = README[README.index("\n", start) + 1: README.index("<!-- end of settings table -->")].strip()
    assert block == settings.markdown_table(), "regenerate the README table from webapp.settings.markdown_table()"


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```sh\n(python3 -m venv .*)\n```", README)
    assert len(commands) == 2, "the README gives exactly two commands: run, and test"
    run, test = commands
    assert "gunicorn -c gunicorn.conf.py wsgi:app" in run and "pytest" in test
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci, ".ci/run must run the README's test command verbatim"


def test_readme_error_table_is_generated_from_the_error_table():
    from webapp import errors

    start = README.index("<!-- error table")
    block = README[README.index("\n", start) + 1: README.index("<!-- end of error table -->")].strip()
    assert block == errors.markdown_table(), "regenerate the README table from webapp.errors.markdown_table()"


def test_readme_classify_exit_table_is_generated_from_the_cli():
    from webapp.cli.common import CLASSIFY_EXIT_STATUS, exit_status_table

    start = README.index("<!-- classify exit table")
    block = README[README.index("\n", start) + 1: README.index("<!-- end of classify exit table -->")].strip()
    assert block == exit_status_table(CLASSIFY_EXIT_STATUS), \
        "regenerate the README table from webapp.cli.common.exit_status_table(CLASSIFY_EXIT_STATUS)"

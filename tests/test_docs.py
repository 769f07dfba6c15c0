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


def test_readme_gives_each_models_preprocessing_as_the_code_has_it():
    """A user reproducing an answer outside the service needs each model's normalization (tryout22: only
    ../shared/README.md and a docstring gave Lite0's 0.498/0.502, and ImageNet's moves dog.jpg's top-1)."""
    from webapp.models import LITE0_PREPROCESSING, _resnet18_preprocessing

    text = " ".join(README.split())
    for pre in (_resnet18_preprocessing(), LITE0_PREPROCESSING):
        assert (pre.resize, pre.crop, pre.interpolation.value) == (256, 224, "bilinear")  # as the README says
        for name in ("mean", "std"):
            assert f"{name} ({', '.join(f'{v:g}' for v in getattr(pre, name))})" in text, (name, pre)
    assert "resize the short side to 256 px (bilinear, antialiased), centre-crop 224" in text

"""Third-party warnings stay out of the operator's output (once each at debug level); ours and errors pass."""

from __future__ import annotations

import logging
import warnings

import pytest

from webapp import quiet

THIRD_PARTY_FILE = "/usr/lib/python3/site-packages/torch/_inductor/mkldnn_lowerings.py"


@pytest.fixture(autouse=True)
def fresh_memory(monkeypatch):
    monkeypatch.setattr(quiet, "_said", set())


def test_other_packages_python_warnings_become_one_debug_line(caplog):
    caplog.set_level(logging.DEBUG, logger="webapp.quiet")
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        with quiet.quiet_third_party():
            for _ in range(3):  # inductor warns once per int8 conv: the operator hears of it once
                warnings.warn_explicit("To copy construct from a tensor, use detach().clone()", UserWarning,
                                       THIRD_PARTY_FILE, 827)
    assert outside == []
    hidden = [r.getMessage() for r in caplog.records if r.name == "webapp.quiet"]
    assert hidden == [f"hidden UserWarning: To copy construct from a tensor, use detach().clone() "
                      f"({THIRD_PARTY_FILE}:827)"]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "webapp.quiet")


def test_our_own_warnings_still_reach_the_operator():
    ours = str(quiet.Path(quiet.__file__))
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        with quiet.quiet_third_party():
            warnings.warn_explicit("CLASSIFIER_X is deprecated", DeprecationWarning, ours, 1)
    assert [(str(w.message), w.category, w.filename) for w in outside] == [
        ("CLASSIFIER_X is deprecated", DeprecationWarning, ours)]


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record):
        self.seen.append(f"{record.levelname} {record.getMessage()}")


def test_torch_warning_lines_are_hidden_errors_pass(caplog):
    """torch's own handlers print its loggers' lines (the KernelPreference deprecation on importing torchao)."""
    caplog.set_level(logging.DEBUG, logger="webapp.quiet")
    torch_log = logging.getLogger("torch")
    printed = Collect()  # stands for torch's stderr handler
    torch_log.addHandler(printed)
    try:
        with quiet.quiet_third_party():
            logging.getLogger("torch.utils._pytree").warning(
                "<enum 'KernelPreference'> is an Enum subclass ... register_constant() ... is deprecated")
            logging.getLogger("torch._test_quiet").error("a real failure")  # (torch._inductor may not propagate)
            verbose = logging.getLogger("torch._test_quiet")
            verbose.setLevel(logging.INFO)  # as TORCH_LOGS does for the loggers it names
            verbose.info("asked for with TORCH_LOGS")
        logging.getLogger("torch.utils._pytree").warning("after the block: printed as usual")
    finally:
        torch_log.removeHandler(printed)
    assert printed.seen == ["ERROR a real failure", "INFO asked for with TORCH_LOGS",
                            "WARNING after the block: printed as usual"]
    assert [r.getMessage() for r in caplog.records if r.name == "webapp.quiet"] == [
        "hidden warning from logger torch.utils._pytree: <enum 'KernelPreference'> is an Enum subclass ... "
        "register_constant() ... is deprecated"]


def test_warnings_are_handled_even_when_the_block_raises():
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="compile failed"):
            with quiet.quiet_third_party():
                warnings.warn_explicit("noise", UserWarning, THIRD_PARTY_FILE, 1)
                raise RuntimeError("compile failed")
    assert outside == []
    assert ("UserWarning", f"noise ({THIRD_PARTY_FILE}:1)") in quiet._said


def test_the_int8_program_is_written_under_a_pt2_name(tmp_path, monkeypatch):
    """torch.export.save warns "Expect archive file to be a file ending in .pt2" for any other name."""
    import torch

    from webapp import quantize

    written = []
    monkeypatch.setattr(torch.export, "save", lambda program, path: (written.append(path), path.write_bytes(b"x")))

    class Program:
        def module(self):
            return "module"

    monkeypatch.setattr(quantize, "quantize_int8", lambda *a, **k: Program())
    quantize.load_or_quantize(torch.nn.Identity(), [torch.zeros(3, 8, 8)], input_size=8, cache_dir=tmp_path,
                              cache_key="k")
    assert len(written) == 1 and written[0].name.endswith(".pt2") and written[0].parent == tmp_path
    assert (tmp_path / "int8-k.pt2").is_file() and not written[0].exists()

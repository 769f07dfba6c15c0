"""Start-up warnings for settings that are allowed but work against the server (webapp/advice.py)."""

import pytest

from webapp import advice, settings


def load(**values):
    return settings.load({f"CLASSIFIER_{k}": str(v) for k, v in values.items()})


def test_the_defaults_warn_of_nothing():
    assert advice.warnings(load(), threads=1, cores=2) == []
    assert advice.warnings(load(MODEL="efficientnet_lite0"), threads=4, cores=4) == []


@pytest.mark.parametrize("values, threads, says", [
    # 3,995 OS threads in one worker on 2 cores, each request ~40x slower, and only "oversubscribed" at INFO (tryout34)
    (dict(THREADS=999), 999, "CLASSIFIER_THREADS=999: more intra-op threads than the 2 cores this server may use; "
                             "each forward pass then shares them among 999 threads"),
    # ready, and 413 for every photo (tryout34)
    (dict(MAX_PIXELS=100), 1, "CLASSIFIER_MAX_PIXELS=100: every photo of more pixels gets 413 too_large, which is "
                              "every photo a camera or phone takes (the model's own input is 224 x 224 = 50,176 "
                              "pixels)"),
    (dict(MAX_REQUEST_PIXELS=1000), 1, "CLASSIFIER_MAX_REQUEST_PIXELS=1,000 is below CLASSIFIER_MAX_PIXELS="
                                       "80,000,000: a single photo within the per-photo limit still gets 413"),
    # 504 "the server is overloaded" on an idle server (tryout34)
    (dict(REQUEST_TIMEOUT_S=0.01), 1, "CLASSIFIER_REQUEST_TIMEOUT_S=0.01 s: a request whose decode and forward pass "
                                      "take longer gets 504 timeout, on an idle server too"),
])
def test_each_setting_against_the_server_is_said_with_what_to_set(values, threads, says):
    said = advice.warnings(load(**values), threads=threads, cores=2)
    assert len(said) == 1 and said[0].startswith(says), said


def test_a_setting_nothing_reads_here_is_said_to_be_unused():
    """They started silently; only CLASSIFIER_WEIGHTS beside another model was said to be unused (tryout34)."""
    assert advice.warnings(load(METRICS=0, METRICS_TOKEN="abc"), threads=1, cores=2) == [
        "CLASSIFIER_METRICS_TOKEN is not used: CLASSIFIER_METRICS=0 serves no /metrics"]
    assert advice.warnings(load(SEED=7, MODEL="efficientnet_lite0"), threads=1, cores=2) == [
        "CLASSIFIER_SEED=7 is not used: it seeds resnet18_seeded's random weights, and "
        "CLASSIFIER_MODEL=efficientnet_lite0 has trained ones"]
    assert advice.warnings(load(SEED=7, MODEL="resnet18_seeded"), threads=1, cores=2) == []


def test_an_empty_torch_home_is_said(monkeypatch, tmp_path):
    """TORCH_HOME='' made torch look in ./hub/checkpoints of wherever the server started, unsaid (tryout34)."""
    monkeypatch.setenv("TORCH_HOME", "")
    monkeypatch.chdir(tmp_path)
    said = advice.warnings(load(MODEL="resnet18"), threads=1, cores=2)
    assert said == [f"TORCH_HOME is set but empty: torch then looks for the weights in hub/checkpoints under the "
                    f"folder the server starts in ({tmp_path}); unset it for ~/.cache/torch, or give it a folder"]
    assert advice.warnings(load(MODEL="efficientnet_lite0"), threads=1, cores=2) == []  # (it reads no hub cache)


def test_a_flag_is_named_as_given():
    """``classify --threads 999`` is named as the flag, not as the variable (settings.given_as)."""
    s = settings.load({}, {"THREADS": 999}, names={"THREADS": "--threads"})
    assert advice.warnings(s, threads=999, cores=2)[0].startswith("--threads=999: ")

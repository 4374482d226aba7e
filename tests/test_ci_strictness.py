"""Under .ci/run (LYCORIS_CI=1) a test may skip only for the version matrix (issue #37): conftest's hook turns any
other skip into a failure (ci_strictness.py). The reasons below are the suite's own, as pytest printed them in a CI log."""

import pytest
from ci_strictness import fail_skip_outside_the_matrix

MATRIX_REASONS = (
    "this ComfyUI has no supported_models.MiniMaxH3",
    "this ComfyUI has no supported_models.ACEStep15 (ComfyUI 0.33 has)",
    "this ComfyUI has no ltx2 text encoder (comfy.text_encoders.lt)",
    "MiniMax H3 exists in ComfyUI 0.33 only (the version matrix)",
    "the kit carries ComfyUI 0.33 (dynamic VRAM); this is an older ComfyUI",
    "ComfyUI 0.3.75 has no bypass loader",
    "ComfyUI 0.3.75 has no dynamic VRAM loading (ModelPatcherDynamic)",
)
OTHER_REASONS = (
    "ComfyUI-GGUF is not unpacked at /x/.deps/custom_nodes/ComfyUI-GGUF: scripts/setup.sh unpacks it",
    "could not import 'peft': No module named 'peft'",
    "the table was traced with diffusers 0.42.1, 0.43.0 is installed",
    "inductor's code generation takes ~75 s on 2 CPU cores, over CI's budget",
)


class Report:
    """The fields of a pytest report the hook reads and writes."""

    def __init__(self, reason: str):
        self.outcome, self.longrepr = "skipped", ("test_x.py", 1, f"Skipped: {reason}")

    @property
    def skipped(self) -> bool:
        return self.outcome == "skipped"


@pytest.mark.parametrize("in_ci", [True, False], ids=["ci", "local"])
@pytest.mark.parametrize("reason", MATRIX_REASONS + OTHER_REASONS)
def test_only_the_version_matrix_may_skip_under_ci(reason, in_ci):
    report = Report(reason)
    fail_skip_outside_the_matrix(report, in_ci)
    fails = in_ci and reason in OTHER_REASONS
    assert report.outcome == ("failed" if fails else "skipped")
    if fails:
        assert "outside the version matrix" in report.longrepr and reason in report.longrepr


def test_an_expected_failure_is_not_a_skip():
    report = Report("known bug")
    report.wasxfail = "known bug"
    fail_skip_outside_the_matrix(report, in_ci=True)
    assert report.outcome == "skipped"

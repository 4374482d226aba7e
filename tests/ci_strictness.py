"""What a test may skip for under .ci/run (LYCORIS_CI=1): tests/conftest.py applies it to every report."""

import re

# The skips .ci/run allows: this ComfyUI lacks what the test is about (a model family, a loader, a mechanism of the
# other ComfyUI of the matrix). Their reasons name it: "this ComfyUI has no …", "ComfyUI 0.3.75 has no …", "… exists in
# ComfyUI 0.33 only", "… an older ComfyUI". Any other skip there (an oracle that failed to import, a dependency not
# unpacked) fails the test: CI must not pass with half its truth missing.
VERSION_MATRIX = re.compile(r"\bthis ComfyUI\b|\bComfyUI 0\.\d+|\ban older ComfyUI\b")


def _skip_reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def fail_skip_outside_the_matrix(report, in_ci: bool) -> None:
    """Under .ci/run (`in_ci`), a skipped report whose reason is not the version matrix becomes a failure."""
    if in_ci and report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not VERSION_MATRIX.search(reason):
            report.outcome = "failed"
            report.longrepr = f"skipped under .ci/run (LYCORIS_CI=1) for a reason outside the version matrix: {reason}"

"""The suite's one reading of CI: what fails instead of skipping."""

from __future__ import annotations

import pytest
from support.ci import skip_or_fail, under_ci


@pytest.mark.parametrize("value", ["true", "TRUE", "1", "yes", " true "])
def test_ci_values_that_mean_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert under_ci()
    with pytest.raises(pytest.fail.Exception, match="no chromium"):
        skip_or_fail("no chromium")


@pytest.mark.parametrize("value", [None, "", "false", "0", "no"])
def test_elsewhere_a_missing_tool_skips(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not under_ci()
    with pytest.raises(pytest.skip.Exception, match="no chromium"):
        skip_or_fail("no chromium")

"""The integrations name the peer releases they are tested with when another one is installed."""
import importlib.metadata

import pytest

from rlkernels.integrations import _versions


@pytest.mark.parametrize("package", sorted(_versions.TESTED))
def test_below_the_range_is_an_error_above_it_a_warning(monkeypatch, package):
    low, high = _versions.TESTED[package]
    versions = {"old": "0.0.1", "tested": low, "new": "99.0"}
    for which, version in versions.items():
        monkeypatch.setattr(importlib.metadata, "version", lambda name, v=version: v)
        if which == "old":
            with pytest.raises(ImportError, match=rf"{package}>={low},<{high}"):
                _versions.check(package)
        elif which == "new":
            with pytest.warns(UserWarning, match=rf"tested with {package}>={low},<{high}, found {package} 99.0"):
                _versions.check(package)
        else:
            _versions.check(package)  # silent

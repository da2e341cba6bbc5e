"""Conformance tests whose expected values come from a framework's own code (the ``[conformance]`` extra, installed
by ``.ci/run``: ``pip install --no-deps`` of the framework, then ``.[conformance]``). A test module named
``test_<framework>*.py`` is skipped, with the reason, where that framework does not import."""

from __future__ import annotations

import importlib.util

import pytest

# test module prefix → (the framework's top-level package, the version its tests are written against)
FRAMEWORKS = {"test_openrlhf": ("openrlhf", "0.11.2")}


def _missing(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is None
    except (ImportError, ValueError):
        return True


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        for prefix, (package, version) in FRAMEWORKS.items():
            if name.startswith(prefix) and _missing(package):
                item.add_marker(pytest.mark.skip(reason=(
                    f"{package} is not installed: pip install --no-deps {package}=={version} and "
                    f"pip install -e '.[conformance]' (see .ci/run)")))

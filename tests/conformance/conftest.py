"""Conformance against the frameworks' own code (the ``[conformance]`` extra plus
``pip install --no-deps verl==0.9.1 openrlhf==0.11.2``, as ``.ci/run`` does).

A framework's heavy imports that the called path never uses (ray, tensordict, transformers, flash-attn, …) are
stubbed in ``sys.modules`` — only those that are not installed, so a real one is never shadowed. Without the
framework installed, its tests skip with the reason."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import pytest

# verl 0.9.1's package imports these at module level; none is called on the path the tests use
# (core_algos' estimators, policy losses, agg_loss, kl_penalty; utils.metric; utils.torch_functional).
VERL_HEAVY = ("ray", "tensordict", "codetiming", "transformers", "flash_attn", "datasets", "orjson", "PIL",
              "peft", "vllm", "deepspeed", "torchdata", "qwen_vl_utils", "torchvision", "liger_kernel", "wandb")


class _StubType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), {})

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls


class _StubModule(types.ModuleType):
    """A module whose capitalized attributes are classes and the rest pass-through decorators."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            value = _StubType(name, (), {})
        else:
            def value(*args, **kwargs):
                return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else (lambda fn: fn)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def install_stubs(heavy) -> None:
    """Stub the modules of ``heavy`` that are not installed (a real installed one is left alone)."""
    missing = [m for m in heavy if m not in sys.modules and importlib.util.find_spec(m) is None]
    if missing and not any(isinstance(f, _StubFinder) and f.roots >= set(missing) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder(missing))


def import_verl():
    """verl 0.9.1's ``core_algos``, ``utils.metric`` and ``utils.torch_functional``, or a skip naming why."""
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed: pip install --no-deps verl==0.9.1 and the [conformance] extra",
                    allow_module_level=True)
    install_stubs(VERL_HEAVY)
    try:
        import verl
        from verl.trainer.ppo import core_algos
        from verl.utils import metric
    except ImportError as exc:
        pytest.skip(f"verl is not importable here ({exc}): the [conformance] extra installs its pure-Python needs",
                    allow_module_level=True)
    version = getattr(verl, "__version__", None)
    if version != "0.9.1":
        pytest.skip(f"verl {version} installed; these tests read verl 0.9.1", allow_module_level=True)
    return core_algos, metric


# OpenRLHF's modules skip through their names (verl's through import_verl above).
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

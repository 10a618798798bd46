"""The notebook API: ``from helpers import ...`` gives every name, lazily, and no name hides a module."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import helpers


def test_every_api_name_resolves_to_the_object_its_module_defines():
    for name, module in helpers._API.items():
        assert getattr(helpers, name) is getattr(importlib.import_module(f"helpers.{module}"), name), name


def test_no_api_name_shadows_a_module():
    modules = {m.name for m in pkgutil.iter_modules(helpers.__path__)}
    assert not modules & set(helpers.__all__), "a function named like its module hides it after `import helpers.x`"


def test_import_helpers_loads_no_heavy_library():
    code = "import sys, helpers; print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unknown_name_is_an_attribute_error():
    try:
        helpers.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_every_oomkit_error_derives_from_the_base():
    import pkgutil

    import helpers
    from helpers.core.errors import OomkitError

    for info in pkgutil.walk_packages(helpers.__path__, "helpers."):
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, Exception)
                and not issubclass(obj, Warning)
                and obj.__module__.startswith("helpers")
            ):
                assert issubclass(obj, OomkitError), f"{obj.__module__}.{obj.__name__}"

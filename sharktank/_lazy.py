"""Package attributes loaded on first use (PEP 562), so that importing a light submodule
(``sharktank.export.manifest``, ``sharktank.weights.errors``...) does not import torch or IREE
through its package's ``__init__``.

A package lists ``name -> submodule`` once and gets its ``__getattr__`` and ``__dir__``::

    _HOMES = {"Session": "session", ...}
    __all__ = list(_HOMES)
    __getattr__, __dir__ = lazy_attributes(__name__, _HOMES)

and names the same imports under ``if TYPE_CHECKING:`` for type checkers and IDEs.

A name must not also be a submodule's (``evaluate.perplexity``, the function, in
``evaluate/perplexity.py``): once anything imports that submodule, the import system sets the
package attribute to the module and ``__getattr__`` is never asked. Such a package imports
its names eagerly (tests/cli/test_cli_package.py checks every lazy package).
"""

from __future__ import annotations

from importlib import import_module
from typing import Callable, Mapping

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose name ``n`` lives in its submodule ``homes[n]``."""

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{home}", package), name)
        globals_of_package = import_module(package).__dict__
        globals_of_package[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(import_module(package).__dict__) | set(homes))

    return __getattr__, __dir__

"""For benchmarks that time code on gloo ranks (``fewbit.experiments.replicas.launch``):
the ranks unpickle the function to run, and its configuration, by their module's name.
A script's own are in ``__main__``, which in a rank is another module; so a script
hands the ranks itself as a module they can import."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType


def importable(script: str) -> ModuleType:
    """The script at path ``script`` (its ``__file__``) imported by its name, its folder on
    the ranks' path (PYTHONPATH, which they inherit)."""
    folder = str(Path(script).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
    return importlib.import_module(Path(script).stem)

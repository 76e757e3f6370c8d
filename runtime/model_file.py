"""Import a user's model file by path (shared by the compiler and the runtime's batches)."""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from types import ModuleType


def model_name(path: str) -> str:
    """An identifier for the model: the file's stem, e.g. ``hf_gpt2`` for ``examples/hf_gpt2.py``."""
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    return stem if stem.isidentifier() else "model"


def import_model_file(path: str, prefix: str) -> ModuleType:
    """Execute the file as module ``<prefix><name>``; exceptions from its code propagate. Its
    directory goes on ``sys.path``, as for ``python model.py``, so that it may import its siblings."""
    name = prefix + model_name(path)
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module

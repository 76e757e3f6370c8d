"""Import a user's model file by path (shared by the compiler and the runtime's batches)."""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any


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


def batch_tuple(batch: Any) -> tuple[Any, tuple[str, ...]]:
    """``example_batch``'s value as the plan's positional batch inputs, and the keyword names
    ``forward`` takes them by: a tensor is a batch of one, a tuple or list is positional (no
    names), a mapping (a dict, Hugging Face's ``BatchEncoding``) is ``forward(**batch)`` in its
    key order. Anything else comes back as it is, for the caller to refuse."""
    if isinstance(batch, Mapping):
        return tuple(batch.values()), tuple(batch.keys())
    if isinstance(batch, (tuple, list)):
        return tuple(batch), ()
    return ((batch,), ()) if hasattr(batch, "shape") else (batch, ())


def call_forward(model, batch: tuple, keys: tuple[str, ...] | list[str] = ()):
    """``model(*batch)``, or ``model(**dict(zip(keys, batch)))`` for a batch given by keyword."""
    return model(**dict(zip(keys, batch))) if keys else model(*batch)


def loss_of(output: Any) -> Any:
    """The loss among ``forward``'s results: the value itself, a mapping's ``"loss"`` (Hugging
    Face's ``ModelOutput``, which has the key only when the loss was computed), or the first of a
    tuple or list (Hugging Face's ``return_dict=False``: ``(loss, logits, ...)``). What is not
    one of these comes back as it is, for the caller to refuse."""
    if isinstance(output, Mapping):
        return output.get("loss", output)
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    return output

"""Load a user's model file and check it follows the model contract.

A model file is plain PyTorch. It defines ``build_model(**kw)`` (a module whose
``forward(*batch)`` returns the scalar loss) and ``example_batch(batch_size, **kw)``.
``--set key=value`` reaches both as keyword arguments. A batch may also be a mapping, taken as
``forward(**batch)``, and forward may return a tuple that starts with the loss or an output
with a ``loss`` (Hugging Face's conventions: ``runtime/model_file.py``).
"""
from __future__ import annotations

import ast
import functools
import inspect
import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from sbpc.errors import ModelError, UsageError
from sbpc.runtime.model_file import batch_tuple, import_model_file, loss_of

CONTRACT_HINT = ("define build_model(**kw) -> nn.Module and example_batch(batch_size, **kw) -> a tensor, a tuple of "
                 "tensors, or a dict of them by forward()'s argument names")


@dataclass
class ModelSource:
    """A loaded model file plus the --set values that configure it."""

    path: str
    module: ModuleType
    sets: dict[str, Any] = field(default_factory=dict)
    # forward()'s keyword names of the batch inputs, known after the first batch() (example_batch
    # returns the same structure every call); () for a positional batch
    keys: tuple[str, ...] | None = None

    def build(self):
        return call_user(self.module.build_model, self.path, **self.sets)

    def batch(self, batch_size: int) -> tuple:
        batch = call_user(self.module.example_batch, self.path, batch_size, **self.sets)
        batch, self.keys = check_batch(batch, self)
        return batch

    def batch_keys(self, batch_size: int) -> tuple[str, ...]:
        """``keys``, from a batch drawn without touching the caller's random stream if none was yet."""
        if self.keys is None:
            import torch

            with torch.random.fork_rng():
                self.batch(batch_size)
        return self.keys


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """``["layers=4", "preset=tiny"]`` -> ``{"layers": 4, "preset": "tiny"}``."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise UsageError(f"bad --set {item!r}", hint="write --set key=value, for example --set layers=4")
        out[key] = _parse_value(raw.strip())
    return out


def _parse_value(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw  # a bare word such as a preset name
    return value if isinstance(value, (int, float, str, tuple, list)) else raw


def load_model(path: str, sets: dict[str, Any] | None = None) -> ModelSource:
    if not os.path.isfile(path):
        raise ModelError(f"model file {path!r} does not exist", hint="pass the path of a .py file that defines build_model")
    try:
        module = import_model_file(path, "_sbpc_model_")
    except SyntaxError as err:
        raise ModelError(f"syntax error in model file: {err.msg}", location=f"{path}:{err.lineno}",
                         hint="fix the Python syntax") from err
    except Exception as err:
        raise ModelError(f"importing {path} failed: {type(err).__name__}: {err}",
                         location=user_location(err, path), hint="the model file must import cleanly with plain PyTorch") from err
    for fn in ("build_model", "example_batch"):
        if not callable(getattr(module, fn, None)):
            raise ModelError(f"model file {path} has no function {fn}()", hint=CONTRACT_HINT)
    return ModelSource(path=path, module=module, sets=dict(sets or {}))


def call_user(fn: Callable, path: str, *args, **kwargs):
    """Call a model-file function; turn a bad --set key into a clear error."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as err:
        raise UsageError(f"{fn.__name__}() in {path} does not accept these --set values: {err}",
                         hint=f"--set keys must be keyword arguments of {fn.__name__}") from err
    try:
        return fn(*args, **kwargs)
    except (ValueError, KeyError) as err:
        raise UsageError(f"{fn.__name__}() rejected the --set values: {err}", location=user_location(err, path),
                         hint="check the --set keys and values the model file accepts") from err


def check_batch(batch: Any, source: ModelSource) -> tuple[tuple, tuple[str, ...]]:
    """The batch as positional tensors, and forward()'s keyword names of them (``batch_tuple``)."""
    import torch

    tensors, keys = batch_tuple(batch)
    if not isinstance(tensors, tuple):
        raise ModelError(f"example_batch() in {source.path} must return a tensor, a tuple of tensors or a dict of "
                         f"them, got {type(batch).__name__}", hint=CONTRACT_HINT)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            what = f"{keys[i]!r}" if keys else f"element {i}"
            raise ModelError(f"example_batch() in {source.path} returned {type(t).__name__} as {what}; every batch "
                             "input must be a tensor", hint="pass constant arguments of forward() through "
                             "build_model (a module attribute) or give them defaults")
    return tensors, keys


def scalar_loss(output: Any, source: ModelSource, forward_loc: str | None):
    """The loss among forward()'s results (``loss_of``), or a ModelError at ``forward_loc``, or at
    the user's ``example_batch`` where a library's output came without a loss (Hugging Face's,
    given no labels)."""
    import torch

    loss = loss_of(output)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    where = forward_loc
    if loss is output and isinstance(output, Mapping):
        got = f"{got} without a loss (keys: {', '.join(output.keys())})"
        if where is None or os.path.abspath(where.rpartition(":")[0]) != os.path.abspath(source.path):
            where = function_location(source.module.example_batch)
    elif loss is not output:
        got += f" first, in a {type(output).__name__}"
    raise ModelError(f"forward() must return the scalar loss, but returned {got}", location=where,
                     hint="reduce the loss to a 0-dim tensor, e.g. with .mean(); a Hugging Face model computes it "
                          "when example_batch gives it labels")


def function_location(fn) -> str | None:
    """``file:line`` of ``fn``'s definition (None where Python cannot tell)."""
    try:
        return f"{display_path(inspect.getsourcefile(fn))}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return None


def user_location(err: BaseException, path: str) -> str | None:
    """The innermost frame of ``err`` in the user's model file, as ``file:line``."""
    target = os.path.abspath(path)
    found = None
    for frame in traceback.extract_tb(err.__traceback__):
        if os.path.abspath(frame.filename) == target:
            found = f"{display_path(frame.filename)}:{frame.lineno}"
    return found


def display_path(filename: str) -> str:
    return _display_path(filename, os.getcwd())


@functools.lru_cache(maxsize=4096)
def _display_path(filename: str, cwd: str) -> str:
    """Cached per working directory (relpath is relative to it): capture asks once per op, for
    a handful of files."""
    rel = os.path.relpath(filename, cwd)
    return filename if rel.startswith("..") else rel

"""Training batches: a language-model loader over a token file or a text file, sharded by the
SBP of the plan's batch inputs; a model file's own ``batches(...)``; or, without ``--data``,
synthetic batches from ``example_batch``. docs/training.md is the user's side of this file.

Token files. ``.npy`` carries its dtype; a raw ``.bin`` takes ``--data-dtype`` or, without it,
the ``dtype`` of a sidecar ``<file>.bin.json`` (what ``sbpc corpus`` writes); neither is an
error, never a guess. Only uint16 and uint32 are accepted. Any other file is UTF-8 text: its
bytes are the tokens (vocabulary 256), or the ids of a Hugging Face ``tokenizers`` JSON file
given with ``--tokenizer``.

Windows and order. Window ``w`` is the tokens ``[w * seq, w * seq + seq + 1)``: inputs and, one
token later, targets. Each epoch visits every window once in the order of a permutation seeded
by (seed, epoch); batches take consecutive samples of that stream (a batch may straddle two
epochs). The position is ``LoaderState(epoch, index)``: ``restore`` of a saved state continues
with exactly the batch that would have come next.

Sharding. A rank builds only its part of each batch input: the cut ``Runner.batch_part``
applies to a batch input (micro-batch split, then this rank's SBP) is applied once, at
construction, to index tensors (global row and column of every element), and each step reads
just the tokens those indices name.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from sbpc.errors import DataError, ModelError, UsageError
from sbpc.runtime.model_file import batch_tuple, import_model_file
from sbpc.runtime.plan import Plan
from sbpc.runtime.runner import BatchSource, LocalBatch

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SCAN_CHUNK = 1 << 24  # tokens per slice of the vocabulary scan: bounded memory on any file

Batch = tuple[torch.Tensor, ...] | LocalBatch


class LoaderState(BaseModel):
    """Where a loader stands: the next sample is sample ``index`` of epoch ``epoch``. A
    checkpoint stores it (``model_dump``) and hands it back to ``restore``."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    epoch: int = Field(default=0, ge=0)
    index: int = Field(default=0, ge=0)


class Batches(Protocol):
    """What the training loop draws from: one batch per step, and a position to save."""

    def next(self) -> Batch: ...

    def state(self) -> LoaderState: ...

    def restore(self, state: LoaderState) -> None: ...


@dataclass(frozen=True)
class Tokens:
    path: str
    ids: np.ndarray  # 1-D, uint16 or uint32; a read-only memory map for token files
    kind: str  # how the file was read, for messages: "npy", "bin (uint16)", "text (bytes)", ...


# ----- reading files


def open_tokens(path: str, *, dtype: str | None = None, tokenizer: str | None = None) -> Tokens:
    """The tokens of ``path`` (see the module docstring for the rules by file kind)."""
    if not os.path.isfile(path):
        raise missing_data(path)
    if os.path.getsize(path) == 0:
        raise DataError(f"data file {path!r} is empty", hint="pass a file with at least seq + 1 tokens")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        tokens = _read_npy(path)
    elif ext == ".bin":
        tokens = _read_bin(path, dtype)
    else:
        tokens = _read_text(path, tokenizer)
    if tokens.ids.size == 0:
        raise DataError(f"data file {path!r} holds no tokens", hint="pass a file with at least seq + 1 tokens")
    return tokens


def missing_data(path: str) -> DataError:
    return DataError(f"data file {path!r} does not exist",
                     hint="pass a .npy or .bin token file or a UTF-8 text file; `sbpc corpus` builds one offline")


def _read_npy(path: str) -> Tokens:
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as err:
        raise DataError(f"data file {path!r} is not a readable .npy array: {err}",
                        hint="write it with numpy.save(path, ids.astype(numpy.uint16))") from err
    if ids.dtype.name not in TOKEN_DTYPES or ids.ndim != 1:
        raise DataError(f"data file {path!r} is a {ids.dtype.name} array of shape {list(ids.shape)}; "
                        f"token files are 1-D uint16 or uint32",
                        hint="save the token ids flat, e.g. numpy.save(path, ids.reshape(-1).astype(numpy.uint16))")
    return Tokens(path, ids, "npy")


def _read_bin(path: str, dtype: str | None) -> Tokens:
    sidecar = path + ".json"
    if dtype is None and os.path.isfile(sidecar):
        try:
            with open(sidecar) as f:
                dtype = json.load(f).get("dtype")
        except (OSError, ValueError, AttributeError) as err:
            raise DataError(f"the sidecar {sidecar!r} of {path!r} is not a JSON object with a dtype",
                            hint='write {"dtype": "uint16"} into it, or pass --data-dtype') from err
    if dtype is None:
        raise DataError(f"the dtype of raw token file {path!r} is unknown",
                        hint=f"pass --data-dtype uint16 or uint32, or write {{\"dtype\": \"uint16\"}} to {sidecar}")
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"token dtype {dtype!r} of {path!r} is not one of {', '.join(TOKEN_DTYPES)}",
                        hint="store token ids as uint16 (vocabularies up to 65536) or uint32")
    item = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    size = os.path.getsize(path)
    if size % item:
        raise DataError(f"data file {path!r} has {size} bytes, not a whole number of {dtype} tokens",
                        hint="the file is truncated or of another dtype; check --data-dtype")
    return Tokens(path, np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r"), f"bin ({dtype})")


def _read_text(path: str, tokenizer: str | None) -> Tokens:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"data file {path!r} is neither .npy, .bin nor UTF-8 text: byte {err.start} is not UTF-8",
                        hint="token files need the extension .npy or .bin; text must be UTF-8") from err
    if tokenizer is None:
        return Tokens(path, np.frombuffer(raw, dtype=np.uint8).astype(np.uint16), "text (bytes)")
    ids = encode_with_tokenizer(text, tokenizer)
    return Tokens(path, ids, f"text (tokenizer {os.path.basename(tokenizer)})")


def encode_with_tokenizer(text: str, tokenizer: str) -> np.ndarray:
    """``text`` as the ids of a Hugging Face ``tokenizers`` JSON file (tokenizer.json)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise UsageError("--tokenizer needs the `tokenizers` package, which is not installed",
                         hint="pip install tokenizers, or train on byte-level tokens (drop --tokenizer)") from err
    if not os.path.isfile(tokenizer):
        raise UsageError(f"tokenizer file {tokenizer!r} does not exist", hint="pass a tokenizer.json file")
    try:
        tok = Tokenizer.from_file(tokenizer)
    except Exception as err:  # the Rust library raises its own exception type for any bad file
        raise UsageError(f"tokenizer file {tokenizer!r} is not a tokenizers JSON file: {err}",
                         hint="pass the tokenizer.json of a Hugging Face tokenizer") from err
    ids = tok.encode(text).ids
    dtype = np.uint16 if max(ids, default=0) < 2**16 else np.uint32
    return np.asarray(ids, dtype=dtype)


# ----- the plan's vocabulary


def plan_vocab(plan: Plan) -> int | None:
    """The vocabulary of the plan's token inputs: the rows of the embedding table that a batch
    input indexes (the weight of the first ``aten.embedding`` whose index is a batch input, in
    its logical shape, also when boxing made the weight another value). None when no batch input
    feeds an embedding (nothing to check)."""
    batch_values = {b.value for b in plan.batch}
    shapes = {s.value: s.shape for s in [*plan.params, *plan.buffers]}
    shapes.update((o, t.shape) for prog in plan.stages for ins in prog.instructions for o, t in zip(ins.outs, ins.types))
    for prog in plan.stages:
        for ins in prog.instructions:
            if ins.op != "aten.embedding.default" or len(ins.args) < 2:
                continue
            weight, index = (getattr(a, "ref", None) for a in ins.args[:2])
            if index in batch_values and weight in shapes:
                return shapes[weight][0]
    return None


def check_vocab(tokens: Tokens, vocab: int) -> None:
    """Refuse a token id the embedding has no row for, naming the file, the id and its position.
    Scans the whole file once, in slices."""
    ids = tokens.ids
    for start in range(0, ids.size, _SCAN_CHUNK):
        part = ids[start:start + _SCAN_CHUNK]
        top = int(part.max())
        if top >= vocab:
            at = start + int(np.argmax(part >= vocab))
            raise DataError(f"token id {int(ids[at])} at position {at} of {tokens.path!r} is beyond the model's "
                            f"vocabulary of {vocab}",
                            hint="use the model's tokenizer, or compile the model with a larger vocabulary "
                                 f"(e.g. --set vocab={_round_up(top + 1)})")


def _round_up(n: int, to: int = 64) -> int:
    return -(-n // to) * to


# ----- the language-model loader


@dataclass(frozen=True)
class LmLayout:
    """How windows fill the plan's batch inputs: ``offsets[i]`` is where input ``i`` starts in its
    window (targets 1 for next-token targets, 0 when the model shifts its labels itself); None
    for an attention mask of ones (Hugging Face's ``attention_mask``: every window is whole)."""
    batch_size: int
    seq: int
    offsets: tuple[int | None, ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def span(self) -> int:
        return self.seq + max(o for o in self.offsets if o is not None)


def lm_layout(plan: Plan, example: tuple[torch.Tensor, ...] | None) -> LmLayout:
    """The layout of the plan's batch inputs: one or two integer tensors ``[batch, seq]``, ids
    then targets. Targets are the next tokens, unless the model file's ``example_batch`` returns
    its targets equal to its inputs (Hugging Face's ``labels=input_ids``: the model shifts). An
    input named ``attention_mask`` (``plan.model.batch_keys``) that the example fills with ones
    is fed ones, wherever it stands."""
    mask = [k == "attention_mask" and example is not None and bool((example[i] == 1).all())
            for i, k in enumerate(plan.model.batch_keys)] or [False] * len(plan.batch)
    specs = [s for s, m in zip(plan.batch, mask) if not m]
    shapes = {tuple(s.shape) for s in plan.batch}
    ints = all(not getattr(torch, s.dtype).is_floating_point and s.dtype != "bool" for s in specs)
    if len(specs) not in (1, 2) or len(shapes) != 1 or len(specs[0].shape) != 2 or not ints:
        got = ", ".join(f"{s.dtype} {s.shape}" for s in plan.batch)
        raise UsageError(f"--data feeds token ids [batch, seq] (and targets), but this plan's batch inputs are {got}",
                         hint="define batches(path, batch_size, seed, **kw) in the model file to supply its own "
                              "(docs/training.md)")
    for s in specs:
        if any("P" in x for x in s.sbp):
            raise UsageError(f"batch input {s.name} is partial ({s.sbp}) in the plan; a token batch cannot be",
                             hint="recompile the plan")
    tokens = [t for t, m in zip(example, mask) if not m] if example is not None else []
    same = len(tokens) == 2 and torch.equal(tokens[0], tokens[1])
    token_offsets = iter((0,) if len(specs) == 1 else (0, 0 if same else 1))
    offsets = tuple(None if m else next(token_offsets) for m in mask)
    batch, seq = specs[0].shape
    return LmLayout(batch, seq, offsets, tuple(getattr(torch, s.dtype) for s in plan.batch))


class LmLoader:
    """Batches of token windows, deterministic given the seed, resumable mid-epoch. ``cut(t, i)``
    is this rank's part of logical batch input ``i`` (``Runner.batch_part``); without it the
    loader yields whole logical batches (one device, or for tests)."""

    def __init__(self, tokens: Tokens, layout: LmLayout, seed: int,
                 cut: Callable[[torch.Tensor, int], torch.Tensor] | None = None):
        self.tokens, self.layout, self.seed, self.cut = tokens, layout, seed, cut
        n = tokens.ids.size
        self.windows = (n - layout.span) // layout.seq + 1 if n >= layout.span else 0
        if self.windows == 0:
            raise DataError(f"data file {tokens.path!r} has {n} tokens, fewer than one window of {layout.span}",
                            hint=f"pass a file of at least {layout.span} tokens, or compile a shorter seq")
        b, s = layout.batch_size, layout.seq
        rows = torch.arange(b).view(b, 1).expand(b, s)
        cols = torch.arange(s).view(1, s).expand(b, s)
        cut = cut or (lambda t, i: t)
        # this rank's elements of each input: (global row, column); an expanded arange costs nothing
        # until the cut copies out this rank's part
        self.index = [(cut(rows, i), cut(cols, i)) for i in range(len(layout.offsets))]
        self.sharded = self.cut is not None
        self._epoch, self._index = 0, 0
        self._perms: dict[int, torch.Tensor] = {}

    def state(self) -> LoaderState:
        return LoaderState(epoch=self._epoch, index=self._index)

    def restore(self, state: LoaderState) -> None:
        if state.index >= self.windows:
            raise DataError(f"loader position {state.index} of epoch {state.epoch} is past the {self.windows} "
                            f"windows of {self.tokens.path!r}",
                            hint="resume with the data file the checkpoint was trained on")
        self._epoch, self._index = state.epoch, state.index

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}  # keep the last and this one
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.windows, generator=gen)
        return self._perms[epoch]

    def _starts(self) -> torch.Tensor:
        """The first token of each row's window, for the whole batch (batch_size numbers), and
        the position moved past it."""
        parts, need = [], self.layout.batch_size
        while need:
            take = min(need, self.windows - self._index)
            parts.append(self._perm(self._epoch)[self._index:self._index + take])
            need -= take
            self._index += take
            if self._index == self.windows:
                self._epoch, self._index = self._epoch + 1, 0
        return torch.cat(parts) * self.layout.seq

    def next(self) -> Batch:
        starts = self._starts()
        out = []
        for (rows, cols), offset, dtype in zip(self.index, self.layout.offsets, self.layout.dtypes):
            if offset is None:  # an attention mask: every token of a window is real
                out.append(torch.ones(rows.shape, dtype=dtype))
                continue
            where = (starts[rows] + cols + offset).numpy()
            out.append(torch.from_numpy(self.tokens.ids[where].astype(np.int64)).to(dtype))
        return LocalBatch(tuple(out)) if self.sharded else tuple(out)


# ----- the other two sources


class ModelBatches:
    """A model file's own ``batches(path, batch_size, seed, **kw)``: an iterable of logical batches
    (tuples of tensors), which the runner cuts per rank. Its position is the number of batches
    drawn (epoch 0); ``restore`` draws that many again from a fresh iterator."""

    def __init__(self, fn: Callable[..., Iterable], path: str, plan: Plan, seed: int):
        self.make = lambda: iter(fn(path, plan.model.batch_size, seed, **plan.model.sets))
        self.it: Iterator = self.make()
        self.drawn = 0
        self.where = plan.model.path
        self.keys = tuple(plan.model.batch_keys)

    def next(self) -> Batch:
        try:
            batch = next(self.it)
        except StopIteration as err:
            raise ModelError(f"batches() of {self.where} ended after {self.drawn} batches",
                             hint="make batches() loop over its data for as many steps as asked (e.g. itertools.cycle)"
                             ) from err
        self.drawn += 1
        if isinstance(batch, Mapping) and self.keys:  # by forward()'s names, in example_batch's order
            missing = [k for k in self.keys if k not in batch]
            if missing:
                raise ModelError(f"batches() of {self.where} gave a batch without {', '.join(map(repr, missing))}",
                                 hint=f"yield the keys example_batch() returns: {', '.join(self.keys)}")
            return tuple(batch[k] for k in self.keys)
        return batch_tuple(batch)[0]

    def state(self) -> LoaderState:
        return LoaderState(index=self.drawn)

    def restore(self, state: LoaderState) -> None:
        self.it, self.drawn = self.make(), 0
        for _ in range(state.index):
            self.next()


class SyntheticBatches:
    """``example_batch`` seeded per step (no ``--data``): the batches of `sbpc check` and of
    `sbpc run` before data existed."""

    def __init__(self, plan: Plan, seed: int):
        self.source, self.step = BatchSource(plan, seed), 0

    def next(self) -> Batch:
        self.step += 1
        return self.source(self.step - 1)

    def state(self) -> LoaderState:
        return LoaderState(index=self.step)

    def restore(self, state: LoaderState) -> None:
        self.step = state.index


@dataclass(frozen=True)
class DataOptions:
    path: str | None = None  # None: synthetic batches
    dtype: str | None = None  # --data-dtype of a raw .bin
    tokenizer: str | None = None


def model_module(plan: Plan):
    path = plan.model.path
    if not os.path.isfile(path):
        raise ModelError(f"the plan's model file {path!r} is not here; it is needed for its batches",
                         hint="run from the directory the plan was compiled in, or copy the model file along")
    return import_model_file(path, "_sbpc_batches_")


def make_batches(plan: Plan, data: DataOptions, seed: int,
                 cut: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> Batches:
    """The batches of a run: synthetic without a data path; the model file's ``batches`` when it
    defines one; else the language-model loader over the file, sharded by ``cut``."""
    if data.path is None:
        return SyntheticBatches(plan, seed)
    module = model_module(plan)
    if callable(getattr(module, "batches", None)):
        return ModelBatches(module.batches, data.path, plan, seed)
    tokens = open_tokens(data.path, dtype=data.dtype, tokenizer=data.tokenizer)
    example = _example(module, plan) if len(plan.batch) > 1 else None
    return LmLoader(tokens, lm_layout(plan, example), seed, cut)


def check_data(plan: Plan, data: DataOptions) -> None:
    """Everything about the data that can be wrong, before any rank starts: the file, its dtype,
    the batch layout, and every token id against the vocabulary."""
    if data.path is None:
        return
    module = model_module(plan)
    if callable(getattr(module, "batches", None)):
        return
    tokens = open_tokens(data.path, dtype=data.dtype, tokenizer=data.tokenizer)
    layout = lm_layout(plan, _example(module, plan) if len(plan.batch) > 1 else None)
    LmLoader(tokens, layout, 0)  # enough tokens for one window
    vocab = plan_vocab(plan)
    if vocab is not None:
        check_vocab(tokens, vocab)


def _example(module, plan: Plan) -> tuple[torch.Tensor, ...] | None:
    fn = getattr(module, "example_batch", None)
    if fn is None:
        return None
    with torch.random.fork_rng():  # the caller's random stream stays as it was
        torch.manual_seed(0)
        return batch_tuple(fn(plan.model.batch_size, **plan.model.sets))[0]


def tokens_per_step(plan: Plan) -> int:
    """Tokens a step trains on: the elements of the first batch input (ids)."""
    return math.prod(plan.batch[0].shape) if plan.batch else 0


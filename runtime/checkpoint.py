"""Resumable, resharding checkpoints: every rank writes its own shards, one index maps them to
logical tensors (docs/checkpoints.md).

Layout of a checkpoint root ``DIR``::

    DIR/step_00000100/index.json              the commit marker: written last, by rank 0
    DIR/step_00000100/rank00000.safetensors   rank 0's shards and its RNG state
    DIR/latest                                "step_00000100": the newest complete checkpoint

A save writes into ``DIR/.tmp-step_00000100`` and renames it when every rank has written and
rank 0 has written the index, so a crash mid-save leaves only a ``.tmp-`` directory, which no
reader takes for a checkpoint. Each logical tensor (parameter, buffer, optimizer state, the
step counter and the fp16 loss-scale states among them) is described by its logical shape and
dtype and, per stored shard, the file, the key, and the logical *regions* the shard holds: a
box (per-dim offset and length) in the logical tensor and where that box starts inside the
stored tensor. A plain split is one region; an interleaved split ``S(d:k)`` is k regions; a
ZeRO-padded state's regions are cut to the logical shape (the padding is never stored). A
region held by several ranks (a broadcast axis) is written once, by the rank whose
coordinate on each such axis is 0; a partial (P) tensor is reduced over its P axes first.

A resume computes, from the reading plan alone, the regions this rank holds of each of its
tensors and reads only those, with safetensors' ``get_slice``: the writer's mesh, dp/tp/pp,
ZeRO and padding never matter. Nothing here is collective except ``Checkpointer.save``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import zlib
from dataclasses import dataclass
from typing import Iterator, Literal

import torch
from pydantic import ValidationError

from sbpc.errors import CheckpointError, OutputError
from sbpc.runtime.checkpoint_index import (SCHEMA_VERSION, INDEX, LATEST, STEP_DIR, RNG_KEY, CUDA_RNG_KEY, Region, Shard, TensorEntry, FileEntry, TrainState, Index, shard_regions, volume)
from sbpc.runtime.files import check_output_dir, write_atomic
from sbpc.runtime.plan import MeshAxis, Plan, TensorSpec, first_problem
from sbpc.runtime.sbp import NdSbp, Partial, Split

# ----- what a rank holds

@dataclass(frozen=True)
class Held:
    """One tensor of a rank: its local value, plan entry and kind."""
    value: torch.Tensor
    spec: TensorSpec
    kind: Literal["param", "buffer", "state"]


def _logical_shape(spec: TensorSpec) -> list[int]:
    return list(getattr(spec, "unpadded", None) or spec.shape)


def _writes(runner, nd: NdSbp) -> bool:
    """Whether this rank writes its shard of a tensor laid out as ``nd``: its coordinate is 0
    on every axis that does not split it, so each region is written once, by the lowest rank
    of the stage holding it."""
    return all(isinstance(s, Split) or i == 0 for s, i in zip(nd, runner.coords))


def _reduced(runner, t: torch.Tensor, nd: NdSbp) -> torch.Tensor:
    """``t`` with its partial axes reduced (every member then holds the sum), so a P tensor
    is stored as the logical value it stands for. A collective on those axes' groups."""
    for axis, s in zip(runner.topology.sbp_axes, nd):
        group = runner.topology.group(axis)
        if isinstance(s, Partial) and len(group) > 1:
            t = runner.backend.communicator.all_reduce(runner.backend.to_device(t), group, s.reduce)
    return t


# ----- save

def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def _tensor_crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy().data) if t.numel() else 0


class Checkpointer:
    """Saves of one run into ``root``: every ``every`` steps (and at the end), keeping the
    ``keep`` newest (0: all)."""

    def __init__(self, root: str, every: int | None = None, keep: int = 0):
        check_output_dir(root, "checkpoints (--save)")
        self.root, self.every, self.keep = root, every, keep

    def due(self, step: int) -> bool:
        """Whether a save follows step ``step`` (1-based: the number of steps done)."""
        return bool(self.every) and step % self.every == 0

    def save(self, runner, train: TrainState) -> str:
        """Write this rank's shards of ``runner`` and, on rank 0 once every rank has written,
        the index; then commit by renaming. A collective: every rank must call it. Returns the
        checkpoint's directory."""
        comm = runner.backend.communicator
        name = step_dir(train.step)
        tmp, final = os.path.join(self.root, f".tmp-{name}"), os.path.join(self.root, name)
        with _writing(final):
            if comm.rank == 0:
                os.makedirs(self.root, exist_ok=True)
                for stale in os.listdir(self.root):  # an earlier save that crashed midway
                    if stale.startswith(".tmp-"):
                        shutil.rmtree(os.path.join(self.root, stale), ignore_errors=True)
                os.makedirs(tmp)
        comm.barrier()
        with _writing(final):
            mine = _write_rank(runner, tmp)
        parts = comm.gather_objects(mine, 0)
        if parts is not None:
            with _writing(final):
                _write_index(runner.plan, train, parts, tmp)
                _commit(tmp, final)
                write_atomic(os.path.join(self.root, LATEST), name + "\n")
                self._rotate()
        comm.barrier()  # no rank goes on (and may die) before the checkpoint is committed
        return final

    def _rotate(self) -> None:
        if self.keep <= 0:
            return
        done = sorted(complete_checkpoints(self.root))
        for _, name in done[:-self.keep]:
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)


@contextlib.contextmanager
def _writing(final: str) -> Iterator[None]:
    """A failed write (no space, no permission) is an OutputError naming the checkpoint."""
    try:
        yield
    except OSError as err:
        raise OutputError(f"cannot write checkpoint {final}: {err.strerror or err}",
                          hint="check the path, the permissions and the free space; the previous checkpoint "
                               "stays the latest") from err


def _write_rank(runner, tmp: str) -> tuple[FileEntry, dict[str, TensorEntry]]:
    """This rank's file (its shards and RNG state) and the index entries of what it wrote."""
    from safetensors.torch import save_file

    rank = runner.backend.communicator.rank
    fname = f"rank{rank:05d}.safetensors"
    tensors: dict[str, torch.Tensor] = {RNG_KEY: torch.get_rng_state()}
    if torch.cuda.is_available() and runner.backend.device.type == "cuda":
        tensors[CUDA_RNG_KEY] = torch.cuda.get_rng_state(runner.backend.device)
    entries: dict[str, TensorEntry] = {}
    for name, held in runner.checkpoint_tensors().items():
        nd = runner.spec_sbp[name]
        t = _reduced(runner, held.value, nd)
        if not _writes(runner, nd):
            continue
        logical = _logical_shape(held.spec)
        regions = shard_regions(held.spec.shape, logical, nd, runner.coords, runner.sizes)
        shards = []
        if regions:
            tensors[name] = t.detach().to("cpu").contiguous()
            shards = [Shard(file=fname, key=name, regions=regions, crc32=_tensor_crc(tensors[name]))]
        entries[name] = TensorEntry(kind=held.kind, shape=logical, dtype=held.spec.dtype, sbp=list(held.spec.sbp),
                                    init=getattr(held.spec, "init", None), shards=shards)
    path = os.path.join(tmp, fname)
    save_file(tensors, path, metadata={"rank": str(rank)})
    rng = {k: _tensor_crc(tensors[k]) for k in (RNG_KEY, CUDA_RNG_KEY) if k in tensors}
    return FileEntry(rank=rank, bytes=os.path.getsize(path), rng=rng), entries


def _write_index(plan: Plan, train: TrainState, parts: list, tmp: str) -> None:
    """Rank 0: every rank's entries in one index, checked to cover each logical tensor exactly
    once (a rank that wrote nothing it should have would make a checkpoint that cannot load)."""
    from sbpc import __version__

    files, tensors = {}, {}
    for file, entries in parts:
        files[f"rank{file.rank:05d}.safetensors"] = file
        for name, e in entries.items():
            have = tensors.get(name)
            tensors[name] = e if have is None else have.model_copy(update={"shards": have.shards + e.shards})
    missing = sorted(set(plan_tensors(plan)) - set(tensors))
    if missing:
        raise CheckpointError(f"checkpoint of step {train.step}: no rank wrote {missing[0]}",
                              hint="this is a bug in sbpc; report it")
    for name, e in tensors.items():
        stored = sum(volume(r) for s in e.shards for r in s.regions)
        if stored != math.prod(e.shape):
            raise CheckpointError(f"checkpoint of step {train.step}: the ranks stored {stored} of the "
                                  f"{math.prod(e.shape)} elements of {name}", hint="this is a bug in sbpc; report it")
    index = Index(sbpc_version=__version__, model=plan.model, mesh=plan.mesh, train=train, files=files,
                  tensors=dict(sorted(tensors.items())))
    write_atomic(os.path.join(tmp, INDEX), index.model_dump_json(indent=1))


def _commit(tmp: str, final: str) -> None:
    """Rename the finished directory into place. An older checkpoint of the same step (a rerun
    into the same root) is moved aside first and removed after."""
    old = None
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, directory name) of every committed checkpoint under ``root``."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, INDEX)):
            out.append((int(m.group(1)), name))
    return out


# ----- find and read

def resolve(path: str) -> str:
    """The checkpoint directory ``path`` names: itself if it holds an index, else the root's
    ``latest`` (if complete), else its newest complete checkpoint."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist",
                              hint="pass a directory written by --save DIR (or one of its step_* directories)")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is a file, not a directory",
                              hint="pass a directory written by --save DIR; a weights file goes to --weights")
    if os.path.isfile(os.path.join(path, INDEX)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        if STEP_DIR.match(name) and os.path.isfile(os.path.join(path, name, INDEX)):
            return os.path.join(path, name)
    done = complete_checkpoints(path)
    if not done:
        what = "only an interrupted save" if any(n.startswith(".tmp-") for n in os.listdir(path)) else "no checkpoint"
        raise CheckpointError(f"{path} holds {what}: no {INDEX} in it or in a step_* directory",
                              hint="a checkpoint is complete once its index.json is written; resume from a directory "
                                   "a finished save wrote, or start without --resume")
    return os.path.join(path, max(done)[1])


def read_index(directory: str) -> Index:
    path = os.path.join(directory, INDEX)
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError as err:
        raise CheckpointError(f"checkpoint {directory} has no {INDEX}", hint="the save did not finish; resume from "
                              "the checkpoint root (it picks the newest complete one)") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint index {path} is not valid JSON: {err}",
                              hint="the file is corrupt or was edited; resume from another checkpoint") from err
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != SCHEMA_VERSION:
        raise CheckpointError(f"checkpoint index {path} has schema_version {version!r}, this sbpc reads version "
                              f"{SCHEMA_VERSION}", hint="resume it with the sbpc version that wrote it")
    try:
        return Index.model_validate(raw)
    except ValidationError as err:
        raise CheckpointError(f"checkpoint index {path} is malformed at {first_problem(err)}",
                              hint="the file is corrupt or was edited; resume from another checkpoint") from err


def check_files(directory: str, index: Index) -> None:
    """Every shard file the index names is there and has the size it was written with."""
    for name, entry in index.files.items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {directory} lacks shard file {name} (rank {entry.rank}'s)",
                                  hint="the checkpoint was copied incompletely; copy the whole directory")
        size = os.path.getsize(path)
        if size != entry.bytes:
            raise CheckpointError(f"checkpoint shard {path} has {size} bytes, the index says {entry.bytes}",
                                  hint="the file is truncated or corrupt; resume from another checkpoint")


def plan_tensors(plan: Plan) -> dict[str, tuple[TensorSpec, str]]:
    return {**{p.name: (p, "param") for p in plan.params}, **{b.name: (b, "buffer") for b in plan.buffers},
            **{s.name: (s, "state") for s in plan.states}}


def check_matches(index: Index, plan: Plan, directory: str) -> None:
    """The checkpoint holds every tensor the plan needs, with the plan's logical shapes. A
    state that is a copy of its parameter (offload's master copy) may be missing: it is
    rebuilt from the parameter; such states the plan lacks are ignored."""
    who = f"checkpoint {directory} (model {index.model.path}, mesh {_mesh(index.mesh)})"
    for name, (spec, kind) in plan_tensors(plan).items():
        entry = index.tensors.get(name)
        if entry is None:
            if getattr(spec, "init", None) == "param":
                continue
            raise CheckpointError(f"{who} has no {kind} {name!r}, which the plan ({plan.model.path}) needs",
                                  hint="resume with a plan of the same model and optimizer (same --set values)")
        if entry.shape != _logical_shape(spec):
            raise CheckpointError(f"{who}: {name} has shape {entry.shape}, the plan expects {_logical_shape(spec)}",
                                  hint="the checkpoint is of a differently sized model; check the --set values")
    extra = sorted(n for n, e in index.tensors.items() if n not in plan_tensors(plan) and e.init != "param")
    if extra:
        raise CheckpointError(f"{who} has {len(extra)} tensors the plan lacks, first {extra[0]!r}",
                              hint="resume with a plan of the same model and optimizer (same --set values)")


def _mesh(mesh: list[MeshAxis]) -> str:
    return ",".join(f"{a.name}={a.size}" for a in mesh)


def open_checkpoint(path: str, plan: Plan | None = None) -> tuple[str, Index]:
    """The checkpoint ``path`` names, its index, checked (files present with their sizes; the
    plan's tensors in it). Cheap: run it before ranks start."""
    directory = resolve(path)
    index = read_index(directory)
    check_files(directory, index)
    if plan is not None:
        check_matches(index, plan, directory)
    return directory, index


class _Reader:
    """Open safetensors files of one checkpoint, read by region."""

    def __init__(self, directory: str):
        self.directory = directory
        self._stack = contextlib.ExitStack()
        self._open: dict[str, object] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def file(self, name: str):
        if name not in self._open:
            from safetensors import safe_open

            path = os.path.join(self.directory, name)
            try:
                self._open[name] = self._stack.enter_context(safe_open(path, framework="pt"))
            except Exception as err:  # safetensors raises its own error types for a bad header
                raise CheckpointError(f"cannot read checkpoint shard {path}: {err}",
                                      hint="the file is corrupt; resume from another checkpoint") from err
        return self._open[name]

    def read(self, shard: Shard, box: tuple[slice, ...] | None) -> torch.Tensor:
        """The stored tensor of ``shard`` (``box``: only that part of it). A whole read checks
        the tensor's checksum."""
        f = self.file(shard.file)
        where = os.path.join(self.directory, shard.file)
        try:
            t = f.get_slice(shard.key)[box] if box is not None else f.get_tensor(shard.key)
        except Exception as err:
            raise CheckpointError(f"cannot read {shard.key} from checkpoint shard {where}: {err}",
                                  hint="the file is corrupt; resume from another checkpoint") from err
        if box is None and _tensor_crc(t) != shard.crc32:
            raise CheckpointError(f"checkpoint shard {where}: {shard.key} does not match its checksum",
                                  hint="the file is corrupt; resume from another checkpoint")
        return t

    def shape(self, shard: Shard) -> list[int]:
        try:
            return list(self.file(shard.file).get_slice(shard.key).get_shape())
        except Exception as err:
            raise CheckpointError(f"checkpoint shard {os.path.join(self.directory, shard.file)} lacks {shard.key}: {err}",
                                  hint="the file is corrupt; resume from another checkpoint") from err

    def rng(self, name: str, entry: FileEntry) -> dict[str, torch.Tensor]:
        """The RNG states of file ``name``, checked against their checksums."""
        return {key: self.read(Shard(file=name, key=key, regions=[], crc32=crc), None) for key, crc in entry.rng.items()}


def _intersect(a: Region, b: Region) -> tuple[list[int], list[int]] | None:
    lo = [max(x, y) for x, y in zip(a.offset, b.offset)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a.offset, a.length, b.offset, b.length)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, [h - l for l, h in zip(lo, hi)]


def read_regions(reader: _Reader, entry: TensorEntry, want: list[Region], out: torch.Tensor, name: str) -> None:
    """Fill the boxes ``want`` of ``out`` (a local shard) from the stored shards of ``entry``."""
    for region in want:
        covered = 0
        for shard in entry.shards:
            for stored in shard.regions:
                hit = _intersect(region, stored)
                if hit is None:
                    continue
                lo, n = hit
                src = tuple(slice(stored.at[d] + lo[d] - stored.offset[d], stored.at[d] + lo[d] - stored.offset[d] + n[d])
                            for d in range(len(lo)))
                dst = tuple(slice(region.at[d] + lo[d] - region.offset[d], region.at[d] + lo[d] - region.offset[d] + n[d])
                            for d in range(len(lo)))
                whole = all(sl.start == 0 for sl in src) and reader.shape(shard) == n
                value = reader.read(shard, None if whole else src)
                out[dst] = value.to(out.dtype)
                covered += math.prod(n)
        if covered != volume(region):
            raise CheckpointError(f"checkpoint {reader.directory}: its shards hold {covered} of the {volume(region)} "
                                  f"elements of {name} this rank needs", hint="the index is corrupt or was edited")


def load_into(runner, path: str) -> TrainState:
    """Replace ``runner``'s parameters, buffers and optimizer states by the checkpoint's (this
    rank's regions of them only), and restore this rank's RNG state when the writer had this
    rank. Returns the training state to resume. Not a collective."""
    from sbpc.runtime.sharding import shard_of

    directory, index = open_checkpoint(path, runner.plan)
    specs = plan_tensors(runner.plan)
    with _Reader(directory) as reader:
        for group in (runner.params, runner.buffers, runner.states):
            for name in list(group):
                spec, _ = specs[name]
                nd = runner.spec_sbp[name]
                entry = index.tensors.get(name)
                if entry is None:  # a master copy (offload) the writer did not have starts as its parameter
                    entry = index.tensors[spec.copies]
                local = torch.zeros(_local_shape(spec, nd, runner.sizes), dtype=getattr(torch, spec.dtype))
                read_regions(reader, entry, shard_regions(spec.shape, _logical_shape(spec), nd, runner.coords,
                                                          runner.sizes), local, name)
                for s, i, k in zip(nd, runner.coords, runner.sizes):
                    if isinstance(s, Partial):  # the logical value on index 0, the reduction's identity elsewhere
                        local = shard_of(local, s, i, k)
                group[name] = runner._place(local, spec)
        mine = f"rank{runner.backend.communicator.rank:05d}.safetensors"
        if mine in index.files:
            rng = reader.rng(mine, index.files[mine])
            if RNG_KEY in rng:
                torch.set_rng_state(rng[RNG_KEY])
            if CUDA_RNG_KEY in rng and runner.backend.device.type == "cuda":
                torch.cuda.set_rng_state(rng[CUDA_RNG_KEY], runner.backend.device)
    runner.steps = index.train.step
    return index.train


def _local_shape(spec: TensorSpec, nd: NdSbp, sizes: tuple[int, ...]) -> tuple[int, ...]:
    from sbpc.runtime.sbp import local_shape

    return local_shape(spec.shape, nd, sizes)


# ----- export

def logical_tensors(path: str, kinds: tuple[str, ...] = ("param", "buffer")) -> Iterator[tuple[str, torch.Tensor]]:
    """Each logical tensor of the given kinds, assembled from its shards (for `sbpc export`)."""
    directory, index = open_checkpoint(path)
    with _Reader(directory) as reader:
        for name, entry in index.tensors.items():
            if entry.kind not in kinds:
                continue
            out = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
            whole = Region(offset=[0] * len(entry.shape), length=list(entry.shape), at=[0] * len(entry.shape))
            read_regions(reader, entry, [whole], out, name)
            yield name, out


def export(path: str, output: str, strip: str | None = None) -> tuple[str, int]:
    """Write the checkpoint's consolidated parameters and buffers to ``output`` (.safetensors);
    ``strip``: keep only names that start with it, without it (a wrapper module's prefix, so
    Hugging Face's ``from_pretrained`` finds its own names). Returns the checkpoint directory
    and the number of tensors written."""
    from safetensors.torch import save_file

    from sbpc.runtime.files import atomic_path, check_output_path

    check_output_path(output, "export (-o)")
    if not output.endswith(".safetensors"):
        raise CheckpointError(f"export file {output!r} is not a .safetensors file",
                              hint="pass -o model.safetensors")
    directory = resolve(path)
    tensors = dict(logical_tensors(directory))
    if strip:
        tensors = {k[len(strip):]: v for k, v in tensors.items() if k.startswith(strip)}
        if not tensors:
            raise CheckpointError(f"no tensor of checkpoint {directory} starts with {strip!r}",
                                  hint="pass the prefix its names share, e.g. --strip model.")
    with atomic_path(output) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    return directory, len(tensors)

"""The checkpoint's index format and region math (docs/checkpoints.md): the pydantic models
of ``index.json`` and which box of a logical tensor a rank's shard holds under its nd-SBP.
``runtime/checkpoint.py`` writes and reads checkpoints with them."""
from __future__ import annotations

import math
import re
from itertools import product
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sbpc.runtime.plan import MeshAxis, ModelRef
from sbpc.runtime.sbp import NdSbp, Split

SCHEMA_VERSION = 1
INDEX = "index.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
RNG_KEY = "rng.torch"  # a rank's torch CPU generator state (uint8), in the rank's own file
CUDA_RNG_KEY = "rng.cuda"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Region(_Model):
    """One box of a stored shard: ``offset``/``length`` per dim in the logical tensor, ``at``
    per dim where the box starts inside the stored tensor."""
    offset: list[int]
    length: list[int]
    at: list[int]


class Shard(_Model):
    file: str  # relative to the checkpoint directory
    key: str  # the tensor's key in that safetensors file
    regions: list[Region]
    crc32: int  # of the stored tensor's bytes; checked wherever a rank reads it whole


class TensorEntry(_Model):
    kind: Literal["param", "buffer", "state"]
    shape: list[int]  # logical (a ZeRO-padded state: its parameter's shape)
    dtype: str  # torch dtype name
    sbp: list[str]  # the writer's nd-SBP, for messages only: a reader never needs it
    init: str | None = None  # states: "param" marks a copy of its parameter (offload's master copy)
    shards: list[Shard]


class FileEntry(_Model):
    rank: int
    bytes: int  # a truncated shard file is caught by its size before it is opened
    rng: dict[str, int] = Field(default_factory=dict)  # the rank's RNG states in it: key -> crc32


class TrainState(_Model):
    """What the training loop resumes besides the tensors: ``step`` steps are done."""
    step: int
    seed: int
    data: dict | None = None  # the data loader's position (``loader.state()``)
    schedule: dict | None = None  # the LR schedule's state


class Index(_Model):
    schema_version: int = SCHEMA_VERSION
    sbpc_version: str
    model: ModelRef  # the writer plan's model, for messages
    mesh: list[MeshAxis]  # the writer's mesh, for messages
    train: TrainState
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]


# ----- regions: which part of a logical tensor a rank's shard holds

Interval = tuple[int, int, int]  # (logical offset, length, offset inside the local tensor)


def _take(ivs: list[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """The logical pieces of local positions [start, start + length) of a dim whose local
    positions are the intervals ``ivs`` laid end to end."""
    out, pos = [], 0
    for off, n in ivs:
        lo, hi = max(start, pos), min(start + length, pos + n)
        if lo < hi:
            out.append((off + lo - pos, hi - lo))
        pos += n
    return out


def _merge(ivs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for off, n in ivs:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


def dim_intervals(n: int, dim: int, nd: NdSbp, coords: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """The logical intervals, in local order, of dim ``dim`` (length ``n``) that the device at
    ``coords`` holds under ``nd``: ``sharding.take_chunk`` applied axis by axis, as
    ``local_shard`` applies it, on index intervals instead of data."""
    ivs = [(0, n)]
    for s, index, size in zip(nd, coords, sizes):
        if not isinstance(s, Split) or s.dim != dim or size == 1:
            continue
        block = sum(k for _, k in ivs) // s.parts
        chunk = block // size
        ivs = _merge([piece for p in range(s.parts) for piece in _take(ivs, p * block + index * chunk, chunk)])
    return ivs


def shard_regions(shape: list[int], logical: list[int], nd: NdSbp, coords: tuple[int, ...],
                  sizes: tuple[int, ...]) -> list[Region]:
    """The boxes of logical tensor ``logical`` that a device's shard of the (maybe padded)
    tensor ``shape`` holds, each with where it sits in the shard. Padding is cut off."""
    per_dim: list[list[Interval]] = []
    for d, n in enumerate(shape):
        local, pos = [], 0
        for off, k in dim_intervals(n, d, nd, coords, sizes):
            end = min(off + k, logical[d])
            if off < end:
                local.append((off, end - off, pos))
            pos += k
        per_dim.append(local)
    return [Region(offset=[i[0] for i in box], length=[i[1] for i in box], at=[i[2] for i in box])
            for box in product(*per_dim)]


def volume(r: Region) -> int:
    return math.prod(r.length)

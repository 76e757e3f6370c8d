"""Cluster descriptions: the hardware a plan is simulated on (``sbpc simulate --cluster``).

A cluster is a small TOML file validated here: per device the dense peak FLOP/s of each dtype,
memory capacity and bandwidth; per node the device count and the intra-node link; between
nodes the NIC bandwidth per device, latency and topology; and the fraction of peak that real
kernels reach per op class (``[efficiency]``). Presets ship in ``clusters/`` (datasheet numbers,
cited in each file); ``--cluster FILE`` reads any other file of the same form.

Where a mesh axis's groups sit is the rank map's business: ranks are row-major over the mesh
axes in rank order (pp outermost, tp innermost), and node ``r // devices`` holds rank ``r``,
so tp ranks share a node and an axis whose stride reaches past a node crosses the network.
"""
from __future__ import annotations

import math
import os
import tomllib
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sbpc.errors import UsageError

PRESET_PACKAGE = "sbpc.clusters"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PeakFlops(_Model):
    """Dense FLOP/s per compute dtype (no 2:4 sparsity)."""
    fp32: float = Field(gt=0)
    tf32: float = Field(gt=0)
    bf16: float = Field(gt=0)
    fp16: float = Field(gt=0)


class Device(_Model):
    name: str
    memory: float = Field(gt=0)  # bytes
    memory_bandwidth: float = Field(gt=0)  # bytes/s
    host_bandwidth: float = Field(gt=0)  # bytes/s each way between device and host memory (PCIe)
    kernel_overhead: float = Field(ge=0)  # s each kernel costs beyond its roofline (launch, ramp, tail)
    # When a GEMM writes its result: "serial", after the main loop of each output tile, the SM's
    # tensor cores idle meanwhile (Ampere's cuBLAS kernels: one 256x128 tile per SM, nothing to
    # hide the epilogue under), or "overlapped", under another tile's main loop (Hopper's
    # warp-specialized ping-pong kernels). Serial adds the result's bytes at memory bandwidth
    # to the roofline: a larger share of a GEMM whose reduction dimension is short.
    gemm_epilogue: Literal["serial", "overlapped"]
    peak_flops: PeakFlops


class Link(_Model):
    bandwidth: float = Field(gt=0)  # bytes/s per device, one direction
    latency: float = Field(ge=0)  # s per message step


class Node(_Model):
    devices: int = Field(gt=0)
    link: Link


class Network(Link):
    topology: Literal["fat-tree"] = "fat-tree"  # non-blocking; oversubscription divides the NIC's share
    oversubscription: float = Field(default=1.0, ge=1.0)


class Efficiency(_Model):
    """Achievable fractions of peak, per op class and per link."""
    gemm: float = Field(gt=0, le=1)  # matmul-like ops, of the dtype's peak FLOP/s
    attention: float = Field(gt=0, le=1)  # a fused (flash) attention kernel, of peak FLOP/s
    memory: float = Field(gt=0, le=1)  # memory-bound ops, of the memory bandwidth
    link: float = Field(gt=0, le=1)  # collectives inside a node, of the link bandwidth
    network: float = Field(gt=0, le=1)  # between nodes, of the NIC bandwidth


class Cluster(_Model):
    name: str
    device: Device
    node: Node
    network: Network
    efficiency: Efficiency

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of an IR dtype (f32 runs as fp32: torch's matmuls default to no TF32)."""
        return {"bf16": self.device.peak_flops.bf16, "f16": self.device.peak_flops.fp16}.get(dtype, self.device.peak_flops.fp32)


def presets() -> list[str]:
    return sorted(f.name.removesuffix(".toml") for f in resources.files(PRESET_PACKAGE).iterdir() if f.name.endswith(".toml"))


def load_cluster(spec: str) -> Cluster:
    """A preset name (``dgx-a100-80g``) or a TOML file path."""
    if os.path.isfile(spec):
        with open(spec, "rb") as f:
            text, where = f.read().decode(), spec
    elif spec in presets():
        text, where = resources.files(PRESET_PACKAGE).joinpath(f"{spec}.toml").read_text(), f"preset {spec}"
    else:
        raise UsageError(f"no cluster {spec!r}: neither a preset nor a file",
                         hint="presets: " + ", ".join(presets()) + "; or pass a TOML file (docs/cost_model.md)")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"cluster {where} is not valid TOML: {err}", location=where,
                         hint="see docs/cost_model.md for the format, or pass a preset") from err
    try:
        return Cluster.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise UsageError(f"cluster {where}: {key}: {first['msg']}", location=where,
                         hint="see docs/cost_model.md for the cluster file's keys") from err


@dataclass(frozen=True)
class AxisGroups:
    """How the groups of one mesh axis sit on the nodes: ``local`` members per node, on ``nodes`` nodes."""
    axis: str
    size: int
    local: int
    nodes: int

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def axis_groups(mesh: list[tuple[str, int]], devices_per_node: int) -> dict[str, AxisGroups]:
    """Per mesh axis (rank order, outermost first), the placement of its group through rank 0;
    every group is a translate of it, so all have its shape when a node's size divides the
    strides (the usual case: powers of two)."""
    out = {}
    for k, (name, size) in enumerate(mesh):
        stride = math.prod(s for _, s in mesh[k + 1:])
        per_node = Counter((i * stride) // devices_per_node for i in range(size))
        out[name] = AxisGroups(name, size, max(per_node.values()), len(per_node))
    return out

"""Materialise a plan's parameters and buffers: replay its init program from a seed, or load
a torch state_dict / safetensors file. Checkpoints are written atomically."""
from __future__ import annotations

import os

import torch

from sbpc.errors import WeightsError
from sbpc.runtime.backend import Backend
from sbpc.runtime.executor import Program
from sbpc.runtime.files import atomic_path
from sbpc.runtime.plan import Plan


def init_weights(plan: Plan, backend: Backend, seed: int) -> dict[str, torch.Tensor]:
    """The weights of ``torch.manual_seed(seed); build_model()``, bit for bit: the init program
    runs where ``build_model`` does, on the backend's ``host_backend()`` (the CPU for cuda too)."""
    host = backend.host_backend()
    gen = torch.Generator(device=host.device)
    gen.manual_seed(seed)
    names = list(plan.init.outputs)
    program = Program(plan.init.instructions, [], [plan.init.outputs[n] for n in names], host,
                      generator=gen, name="init")
    return dict(zip(names, program.run([])))


def check_weights_path(path: str) -> None:
    """Fail early (before ranks are spawned) on a weights file that is not there."""
    if not os.path.isfile(path):
        raise WeightsError(f"weights file {path!r} does not exist", hint="pass a torch state_dict (.pt) or a .safetensors file")


def load_weights(path: str, plan: Plan) -> dict[str, torch.Tensor]:
    """The logical state dict of ``path``, checked against the plan. On a mesh every rank loads
    the whole file and the Runner keeps the rank's shards."""
    check_weights_path(path)
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors = load_file(path)
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise WeightsError(f"cannot read weights file {path}: {type(err).__name__}: {err}",
                           hint="the file is corrupt or not a state_dict") from err
    return check_weights(tensors, plan, path)


def check_weights(tensors: dict, plan: Plan, path: str) -> dict[str, torch.Tensor]:
    needed = {s.name: s for s in [*plan.params, *plan.buffers]}
    missing = sorted(set(needed) - set(tensors))
    if missing:
        raise WeightsError(f"weights file {path} lacks {len(missing)} tensors, first {missing[0]!r}",
                           hint="the file must hold every parameter and buffer of the model, by module path")
    out = {}
    for name, spec in needed.items():
        t = tensors[name]
        if list(t.shape) != spec.shape:
            raise WeightsError(f"weights file {path}: {name} has shape {list(t.shape)}, the plan expects {spec.shape}",
                               hint="the weights come from a differently sized model; check the --set values")
        out[name] = t.to(getattr(torch, spec.dtype))
    return out


def save_weights(tensors: dict[str, torch.Tensor], path: str) -> None:
    with atomic_path(path) as tmp:
        if path.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        else:
            torch.save(tensors, tmp)

"""What a user asks of memory: ZeRO stage, activation recompute, precision, offload and the
device budget (``--zero``, ``--recompute``, ``--precision``, ``--offload``, ``--device-memory``,
or the config's ``[memory]`` table). One typed value, passed to the passes that carry it out."""
from __future__ import annotations

import re
from dataclasses import dataclass

from sbpc.errors import UsageError
from sbpc.runtime.kinds import Precision, Recompute

ZERO_STAGES = (0, 1, 2, 3)
MEMORY_FLAGS = ("zero", "recompute", "precision", "offload", "device_memory")  # flags and [memory] keys
OFFLOADS = ("none", "optimizer")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class MemoryOptions:
    zero: int = 0  # ZeRO stage on the dp axis: 1 optimizer state, 2 + gradients, 3 + parameters S(0)
    recompute: Recompute = Recompute.NONE
    precision: Precision = Precision.FP32
    offload: str = "none"  # "optimizer": optimizer state and update on the host
    device_memory: int | None = None  # bytes per device; None: no budget


def parse_bytes(text: str, what: str = "--device-memory") -> int:
    """``80GB``, ``40GiB``, ``512MB`` or a plain byte count -> bytes (GB = 1e9, GiB = 2**30)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"{what} {text!r} is not a memory size", hint="write e.g. 80GB, 40GiB or 512MB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def memory_options(zero=None, recompute=None, precision=None, offload=None, device_memory=None,
                   where: str = "") -> MemoryOptions:
    """Validated options from flags or a config table (None: not given, the default)."""
    if zero is not None and (isinstance(zero, bool) or zero not in ZERO_STAGES):
        raise UsageError(f"zero stage {zero!r} is not one of 0, 1, 2, 3", location=where or None,
                         hint="1 shards optimizer state over dp, 2 also gradients, 3 also parameters")
    try:
        rec = Recompute(recompute) if recompute is not None else Recompute.NONE
        prec = Precision(precision) if precision is not None else Precision.FP32
    except ValueError as err:
        raise UsageError(str(err), location=where or None,
                         hint="recompute: none, selective, full, auto; precision: fp32, bf16, fp16") from None
    if offload is not None and offload not in OFFLOADS:
        raise UsageError(f"offload {offload!r} is not one of {', '.join(OFFLOADS)}", location=where or None,
                         hint="optimizer keeps the optimizer state and its update on the host")
    budget = parse_bytes(device_memory) if device_memory is not None else None
    if rec == Recompute.AUTO and budget is None:
        raise UsageError("--recompute auto needs --device-memory", location=where or None,
                         hint="auto picks the least recompute that fits the budget, e.g. --device-memory 80GB")
    return MemoryOptions(zero=zero or 0, recompute=rec, precision=prec, offload=offload or "none", device_memory=budget)

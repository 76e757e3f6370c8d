"""What one task of a rank's pipeline order does, worked out once when the runner is built.

A step fires each task of the order: receive, post the next task's receives, run the program,
accumulate, send. Everything about those but the tensors is the same every step (shapes,
dtypes, peers, tags, the error labels, which outputs are accumulated, when a micro-batch's
values die), so ``PipelineRunner`` builds one ``TaskRun`` per task of its order and a step
only reads them: at M = 8 on 1x1x2 a rank fires 17 tasks a step, and each post or send
otherwise parsed SBP strings, formatted labels and looked up peers and tags.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sbpc.runtime.executor import Program


@dataclass(frozen=True)
class Post:
    """A receive from another stage, posted before its task runs (``Communicator.post_recv``)."""
    key: tuple[str, int | None]  # (the transfer's value, micro-batch): where the step keeps the posted work
    shape: list[int]
    dtype: torch.dtype
    peer: int
    tag: int
    what: str


@dataclass(frozen=True)
class Recv:
    """A value the task receives: handed over on this stage (``here``) or a posted receive."""
    key: tuple[str, int | None]
    out: str
    here: bool
    host: bool  # a host-memory value (``host_transfers``): back to the host if it came over NCCL


@dataclass(frozen=True)
class Out:
    """A value the task sends: kept for a task of this stage (``here``) or sent to ``peer``."""
    value: str
    key: tuple[str, int | None]
    here: bool
    peer: int
    tag: int
    what: str


@dataclass(frozen=True)
class TaskRun:
    label: str  # ``fmt(task)``: the timeline's name
    mb: int | None
    program: Program
    posts: tuple[Post, ...]
    recvs: tuple[Recv, ...]
    reads: tuple[tuple[str, str], ...]  # (value the task reads, the accumulator it is)
    inputs: tuple[str, ...]  # the program's inputs looked up in the environments
    local_inputs: tuple[str, ...]  # then those the task received or read (in its environment)
    outputs: tuple[str, ...]
    accumulate: tuple[tuple[int, str, bool], ...]  # (output position, value, fresh: TaskGraph.owned)
    sends: tuple[Out, ...]
    frees_mb: bool  # the last task of its micro-batch on this rank: the micro-batch's values die

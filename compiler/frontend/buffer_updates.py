"""Buffers the forward updates (BatchNorm's running statistics) become typed step outputs.

Eager BatchNorm in training mode writes its running mean and variance in place
(``native_batch_norm``) and adds one to ``num_batches_tracked`` (``add_``). A graph input
mutated in place is not SSA, so each such write becomes its out-of-place form with a fresh
result, later readers of the buffer read that result, and the step gets an ``UPDATE`` output
naming the buffer: the runtime keeps it as the buffer's storage for the next step, exactly as it
keeps a parameter's update. What is rewritten:

- ``native_batch_norm(x, w, b, running_mean, running_var, True, momentum, eps)`` ->
  ``_native_batch_norm_legit_functional`` with the same arguments, whose last two results are
  the new running statistics (torch's own functional form, the same kernel);
- an in-place op whose first argument is the buffer itself and that has an out-of-place
  overload with the same arguments (``add_``, ``mul_``, ``copy_``, ``index_put_`` ...);
- an ``out=`` op writing the whole buffer (spectral normalization's power iteration,
  ``F.normalize(torch.mv(w, v), dim=0, out=u)``) -> its out-of-place overload, whose result,
  of the buffer's type, is the new value.

Anything else (a write through a view of a buffer, a parameter written in place) is left as
it is and refused by ``capture._refuse_input_mutation`` with the user's line. Writes are
per step: with micro-batches each micro-batch's forward would update the statistics in turn,
which the schedule does not model, so capture refuses that combination (``refuse_microbatches``).
"""
from __future__ import annotations

from dataclasses import replace

from sbpc.compiler.ir.aten import defaults_for, functional_variant, out_functional, shares_storage
from sbpc.compiler.ir.mesh import Mesh
from sbpc.compiler.ir.types import GraphInput, InputKind, Node, Ref, rename_uses
from sbpc.errors import ModelError

BATCH_NORM = "aten.native_batch_norm.default"
BATCH_NORM_FUNCTIONAL = "aten._native_batch_norm_legit_functional.default"
_RUNNING = (3, 4)  # native_batch_norm's running_mean and running_var arguments


def functionalize_buffer_writes(nodes: list[Node], inputs: list[GraphInput]) -> tuple[list[Node], dict[str, str]]:
    """The nodes with every supported buffer write made out of place, and each written
    buffer's name -> the value holding its new value at the end of the forward."""
    buffer_of = {i.value: i.name for i in inputs if i.kind == InputKind.BUFFER}
    type_of = {i.value: i.type for i in inputs if i.kind == InputKind.BUFFER}
    current: dict[str, str] = {}  # buffer input value -> its latest value
    latest = {v: v for v in buffer_of}  # and back: a buffer's latest value -> its input value
    new_value: dict[str, str] = {}
    views: dict[str, list[str]] = {}  # a buffer's latest value -> the views taken of it
    last_read = {v: k for k, n in enumerate(nodes) for v in n.uses()}
    out = []
    for k, n in enumerate(nodes):
        if current:
            n = rename_uses(n, lambda v: current.get(v, v))
        if n.args and isinstance(n.args[0], Ref) and n.args[0].name in latest and shares_storage(n.op):
            views.setdefault(n.args[0].name, []).extend(n.outputs)
        written = _rewrite(n, latest, type_of)
        if written is None:
            out.append(n)
            continue
        n, writes = written
        for original, value in writes:
            old = current.get(original, original)
            if any(last_read.get(v, -1) > k for v in views.get(old, ())):
                raise ModelError(f"forward() reads a view of buffer {buffer_of[original]!r} after updating the buffer "
                                 f"in place ({nodes[k].op})", location=str(n.loc) if n.loc else None,
                                 hint="take the view after the update, or write the buffer out of place")
            del latest[old]
            current[original], latest[value] = value, original
            new_value[buffer_of[original]] = value
        out.append(n)
    return out, new_value


def _rewrite(n: Node, latest: dict[str, str], type_of: dict) -> tuple[Node, list[tuple[str, str]]] | None:
    """``n`` out of place and the (buffer input, new value) pairs it writes; None: ``n``
    writes no buffer in a form rewritten here. ``latest``: a buffer's latest value -> its input;
    ``type_of``: a buffer input's type (a write keeps it)."""
    if n.op == BATCH_NORM and len(n.args) > 5 and n.args[5] is True:
        running = [n.args[k] for k in _RUNNING]
        if not all(isinstance(a, Ref) and a.name in latest for a in running):
            return None
        stats = [f"{n.outputs[0]}_new_{k}" for k in ("running_mean", "running_var")]
        types = [*n.types, *(type_of[latest[a.name]] for a in running)]
        node = replace(n, op=BATCH_NORM_FUNCTIONAL, outputs=[*n.outputs, *stats], types=types)
        return node, [(latest[a.name], s) for a, s in zip(running, stats)]
    out = n.kwargs.get("out")
    if isinstance(out, Ref) and out.name in latest and out_functional(n.op) and n.types == [type_of[latest[out.name]]]:
        kwargs = {k: v for k, v in n.kwargs.items() if k != "out"}
        return replace(n, op=out_functional(n.op), kwargs=kwargs), [(latest[out.name], n.outputs[0])]
    target = n.args[0] if n.args else None
    functional = functional_variant(n.op)
    if not (isinstance(target, Ref) and target.name in latest and functional and len(n.outputs) <= 1):
        return None
    fresh = n.outputs[0] if n.outputs else f"{target.name}_new"
    node = replace(n, op=functional, args=defaults_for(n.op, functional, n.args), outputs=[fresh],
                   types=n.types or [type_of[latest[target.name]]])
    return node, [(latest[target.name], fresh)]


class BufferWritesOverMicrobatches(ModelError):
    """The forward updates buffers and the mesh has micro-batches: the driver retries with one
    micro-batch a step where the count was only the default."""


def refuse_microbatched_writes(writes: dict[str, str], nodes: list[Node], mesh: Mesh) -> None:
    """Each micro-batch's forward would update the buffer in turn, a dependency from one
    micro-batch's forward to the next that the schedule does not model (docs/training.md)."""
    if not writes or mesh.microbatches == 1:
        return
    name, value = next(iter(writes.items()))
    loc = next((n.loc for n in nodes if value in n.outputs), None)
    raise BufferWritesOverMicrobatches(f"forward() updates buffer {name!r} (e.g. BatchNorm running statistics), which is "
                                       f"not supported with {mesh.microbatches} micro-batches yet",
                                       location=str(loc) if loc else None,
                                       hint="compile with --microbatches 1 (a pipeline then runs one micro-batch a "
                                            "step), or call .eval() on that module in build_model")

"""Capture: trace a model file into the logical IR, with no weight allocated.

The model is built and called inside one FakeTensorMode, so a 1T-parameter model traces on a
laptop. ``make_fx`` records the joint forward + backward graph (autograd runs under the
tracer); module hooks tag each op with its module path. The optimizer update is appended
as graph ops, and the recorded init program becomes the graph's ``init`` region. On a mesh
with pp > 1, forward ops that a ``sbpc.stage`` scope or a ``[stages]`` glob names get that
chunk in ``Node.stage`` (a hint the stage-partition pass completes).
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import operator
import os
import re
import traceback
from dataclasses import replace
from unittest import mock

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental import symbolic_shapes
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

import sbpc.compiler
import sbpc.runtime
from sbpc.compiler.gc_pause import no_cycle_collection
from sbpc.compiler.frontend.fx_import import MODULE_KEY, import_fx, tensor_type, value_name
from sbpc.compiler.frontend import loss_scale
from sbpc.compiler.frontend.as_strided import plain_views
from sbpc.compiler.frontend.rowwise_modules import rowwise_modules
from sbpc.compiler.frontend.buffer_updates import functionalize_buffer_writes, refuse_microbatched_writes
from sbpc.compiler.frontend.rrelu import rrelu_as_leaky_relu
from sbpc.compiler.frontend.constant_reads import ConstantReads
from sbpc.compiler.frontend.eager_effects import no_reseeding, plus_accumulated
from sbpc.compiler.frontend.input_checks import unreduce
from sbpc.compiler.frontend.random_layout import draw_in_memory_order, memory_orders
from sbpc.compiler.frontend.functionalize import functionalize
from sbpc.compiler.frontend.hint_op import hint_op, hint_inputs
from sbpc.compiler.frontend.hints import ACTIVE, STAGE_KEY, HintRecorder, ParallelConfig
from sbpc.compiler.frontend.init_record import InitRecorder, whole_draws
from sbpc.compiler.frontend.repeated_layers import Repeated, find_repeated
from sbpc.compiler.frontend.stamp import NotStampable, Stamper
from sbpc.compiler.frontend.stamp_expand import expand
from sbpc.compiler.ir.types import Graph, GraphInput, GraphOutput, InputKind, Node, OutputKind, Ref, Role, producers, rename_uses
from sbpc.compiler.ir.aten import is_mutating, shares_storage
from sbpc.compiler.ir.mesh import Mesh
from sbpc.compiler.frontend.model_loader import (CONTRACT_HINT, ModelSource, display_path, function_location,
                                                 scalar_loss, user_location)
from sbpc.compiler.frontend.optim import OptimizerConfig, append_optimizer
from sbpc.runtime.kinds import Precision
from sbpc.runtime.model_file import model_name
from sbpc.runtime.plan import PrecisionSpec
from sbpc.runtime.precision import autocast
from sbpc.errors import CaptureError, ModelError, SbpcError


@no_cycle_collection()
def capture(source: ModelSource, mesh: Mesh, batch_size: int, optimizer: OptimizerConfig,
            config: ParallelConfig | None = None, precision: PrecisionSpec = PrecisionSpec(),
            stamp: bool = True) -> Graph:
    """The joint graph of ``source``. Hints (``sbpc.shard`` calls and ``config``) become
    ``sbpc.hint`` ops: on parameters right after the inputs, on activations where they occur.
    Under bf16 or fp16 the forward is traced inside ``torch.autocast``, so the graph holds
    torch's own casts (``_to_copy``) around the ops autocast lowers or keeps in fp32; the
    parameters stay fp32 inputs and their gradients fp32 outputs (docs/precision.md).
    ``stamp``: trace one of the model's repeated layers and stamp out the others (``stamp.py``:
    the same graph, in a fraction of the time); False traces every layer."""
    config = config or ParallelConfig()
    hints = HintRecorder()
    token = ACTIVE.set(hints)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            recorder = InitRecorder()
            with recorder, whole_draws():
                model = _build(source)
            config.check_modules([n for n, _ in model.named_modules()])
            batch = tuple(fake.from_tensor(b) if not fake.is_our_fake(b) else b for b in source.batch(batch_size))
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            buffers = plan_buffers(model)
            param_hints = config.param_hints([n for n, _ in params])
            param_hints.update({n: hints.params[id(p)] for n, p in params if id(p) in hints.params})
            with _module_output_hints(model, config):
                scale = [torch.empty((), dtype=torch.float32)] if precision.loss_scaling else []
                repeated = find_repeated(model, config) if stamp else None
                graph = _trace_joint(model, source, params, buffers, batch, precision.compute, scale, repeated)
            init_nodes, init_outputs = recorder.to_init_region(params + buffers)
    finally:
        ACTIVE.reset(token)
    entries = [(InputKind.PARAM, n, p) for n, p in params] + [(InputKind.BUFFER, n, b) for n, b in buffers]
    entries += [(InputKind.BATCH, f"batch.{i}", b) for i, b in enumerate(batch)]
    imported = import_fx(graph, [value_name(n) for _, n, _ in entries] + [loss_scale.scale_input().value] * len(scale))
    names = imported.names
    inputs = [GraphInput(kind, names[ph], tensor_type(t), n) for (kind, n, t), ph in zip(entries, imported.placeholders)]
    inputs += [loss_scale.scale_input()] * len(scale)
    if mesh.size("pp") > 1:  # without a pipeline stage hints mean nothing: one config serves every mesh
        imported.nodes = _stage_hints(graph, imported.nodes, config)
    # buffer writes first: ``buf.mul_(m).add_(x)`` writes the buffer twice, the second time
    # through the alias mul_ returns, which functionalize would take for a private temporary
    nodes, buffer_writes = functionalize_buffer_writes(rrelu_as_leaky_relu(imported.nodes), inputs)
    read_after = frozenset(names[o] for o in imported.outputs if o is not None) | frozenset(buffer_writes.values())
    types = {i.value: i.type for i in inputs} | {o: t for n in nodes for o, t in zip(n.outputs, n.types)}
    nodes, renamed = functionalize(unreduce(nodes, types), {i.value for i in inputs}, read_after)
    nodes = draw_in_memory_order(nodes, memory_orders(graph, names))
    buffer_writes = {name: renamed.get(v, v) for name, v in buffer_writes.items()}
    refuse_microbatched_writes(buffer_writes, nodes, mesh)
    hinted = hint_inputs(inputs, param_hints)
    if hinted:
        to_hint = {n.args[0].name: n.outputs[0] for n in hinted}
        nodes = hinted + [rename_uses(n, lambda v: to_hint.get(v, v)) for n in nodes]
    _refuse_input_mutation(nodes, inputs)
    value = lambda fx_node: renamed.get(names[fx_node], names[fx_node])
    loss, *grads = imported.outputs
    outputs = [GraphOutput(OutputKind.LOSS, value(loss), "loss")]
    # a parameter the loss does not reach (a pooler the loss skips) gets no gradient: torch.optim
    # skips it (grad None) and leaves it as it is, so the plan takes it as a frozen one, a buffer
    unused = {fqn for (fqn, _), g in zip(params, grads) if g is None}
    inputs = [replace(i, kind=InputKind.BUFFER) if i.kind == InputKind.PARAM and i.name in unused else i for i in inputs]
    outputs += [GraphOutput(OutputKind.GRAD, value(g), fqn) for (fqn, _), g in zip(params, grads) if g is not None]
    found = None
    if precision.loss_scaling:  # the optimizer reads, and the step returns, unscaled gradients
        types = {v: t for n in nodes for v, t in zip(n.outputs, n.types)}
        found, unscaled = loss_scale.append_unscale([(o.value, types[o.value]) for o in outputs[1:]], nodes)
        outputs[1:] = [replace(o, value=v) for o, v in zip(outputs[1:], unscaled)]
    grad_of = {o.name: o.value for o in outputs if o.kind == OutputKind.GRAD}
    made_at = {v: init_nodes[i].loc for v, i in producers(init_nodes).items()}
    created = {o.name: made_at.get(o.value) for o in init_outputs}
    plist = [(i.name, i.value, i.type, grad_of[i.name], created.get(i.name)) for i in inputs if i.kind == InputKind.PARAM]
    append_optimizer(optimizer, plist, inputs, nodes, outputs)
    if found is not None:
        loss_scale.append_skip(precision.loss_scaling, found, inputs, nodes, outputs)
    # after the skip: eager's forward updated the running statistics even when fp16 skips the step
    outputs += [GraphOutput(OutputKind.UPDATE, v, name) for name, v in buffer_writes.items()]
    inputs, outputs = _canonical_order(inputs, outputs)
    return Graph(name=model_name(source.path), mesh=mesh, inputs=inputs, nodes=nodes,
                 outputs=outputs, init=init_nodes, init_outputs=init_outputs, rowwise=rowwise_modules(model))


def _stage_hints(graph: torch.fx.Graph, nodes: list[Node], config: ParallelConfig) -> list[Node]:
    """Forward ops traced inside a ``sbpc.stage`` scope, or run by a module a ``[stages]`` glob
    names, get that chunk as ``Node.stage``; an in-code scope wins over the config."""
    by_name = {n.name: n for n in graph.nodes}
    out = []
    for n in nodes:
        chunk = None
        if n.role == Role.FORWARD:
            fx = _fx_producer(by_name, n.outputs)
            chunk = (fx.meta.get("custom") or {}).get(STAGE_KEY) if fx is not None else None
            if chunk is None and n.loc is not None:
                hint = config.stage_hint(n.loc.module)
                chunk = hint.chunk if hint is not None else None
        out.append(n if chunk is None else replace(n, stage=chunk))
    return out


def _fx_producer(by_name: dict, outputs: list[str]):
    """The fx node behind an IR node: its results are named after it, its getitem users, or
    ``<name>_r<i>`` for results nobody reads (see fx_import)."""
    for o in outputs:
        fx = by_name.get(o)
        if fx is not None:
            return fx.args[0] if fx.target is operator.getitem else fx
        m = re.fullmatch(r"(.+)_r\d+", o)
        if m and m.group(1) in by_name:
            return by_name[m.group(1)]
    return None


def _refuse_input_mutation(nodes, inputs: list[GraphInput]) -> None:
    """What ``functionalize_buffer_writes`` left in place on an input, or on a view of one, is
    refused here with the user's line."""
    by_value = {i.value: i for i in inputs}
    view_of: dict[str, GraphInput] = {}  # a view's value -> the input whose storage it shares
    for n in nodes:
        target = n.args[0].name if n.args and isinstance(n.args[0], Ref) else None
        whole = by_value.get(target)
        i = whole or view_of.get(target)
        if i is not None and is_mutating(n.op):
            how = "in place" if whole else "through a view"
            hint = ("state updated during forward is supported for buffers written whole, in place or out of place "
                    "(BatchNorm running stats, buf.mul_(m).add_(x), buf.copy_(new)), not for parameters; "
                    "call .eval() on that module in build_model" if whole else
                    "writing part of a buffer is not supported; write the whole buffer "
                    "(buf.copy_(torch.cat([...])) or buf.mul_(mask))")
            if i.kind == InputKind.PARAM:  # a parameter written through a view is no buffer's case
                hint = "a plan writes parameters only in the optimizer step, not in forward()" + (
                    "; nn.Embedding(max_norm=...) renormalizes the rows it looks up in place: drop max_norm"
                    if n.op == "aten.embedding_renorm_.default" else "")
            raise ModelError(f"forward() updates {i.kind.value} {i.name!r} {how} ({n.op})",
                             location=str(n.loc) if n.loc else None, hint=hint)
        if i is not None and shares_storage(n.op):
            view_of.update((o, i) for o in n.outputs)


def _canonical_order(inputs: list[GraphInput], outputs: list[GraphOutput]):
    """Inputs by kind (params, buffers, states, batch, hyper); outputs loss, grads, updates in input
    order, then metrics."""
    kinds = list(InputKind)
    inputs = sorted(inputs, key=lambda i: kinds.index(i.kind))
    rank = {i.name: n for n, i in enumerate(inputs)}
    okinds = [OutputKind.LOSS, OutputKind.GRAD, OutputKind.UPDATE, OutputKind.METRIC]
    outputs = sorted(outputs, key=lambda o: (okinds.index(o.kind), rank.get(o.name, -1)))
    return inputs, outputs


def plan_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors a plan takes as buffers: frozen parameters (``requires_grad_(False)``: Whisper's
    sinusoidal positions), then the module's buffers."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    return frozen + list(model.named_buffers())


def plan_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a plan may take, parameter or buffer, by name: a parameter the loss does not
    reach is a plan buffer though it requires grad (``capture``)."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


def _build(source: ModelSource) -> torch.nn.Module:
    try:
        model = source.build()
    except SbpcError:
        raise
    except Exception as err:
        hint = "build_model must run under plain PyTorch; it is called with fake tensors"
        if "Couldn't swap" in str(err):  # torch cannot swap fake parameters in Module._apply
            hint = ("converting a built module (.to(dtype), .half(), .double()) does not work on fake tensors; "
                    "create the parameters in their dtype instead (dtype= arguments or torch.set_default_dtype)")
        raise ModelError(f"build_model() failed: {type(err).__name__}: {err}", location=user_location(err, source.path),
                         hint=hint) from err
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"build_model() in {source.path} returned {type(model).__name__}, not an nn.Module", hint=CONTRACT_HINT)
    return model.train()


def _trace_joint(model, source: ModelSource, params, buffers, batch, precision: Precision,
                 scale: list[torch.Tensor], repeated: Repeated | None = None) -> torch.fx.Graph:
    """``scale``: fp16's loss scale (one 0-d tensor) or nothing; the gradients are those of
    ``loss * scale``, as after ``GradScaler.scale(loss).backward()``. ``repeated``: layers
    to trace once and stamp out (``stamp.py``)."""
    names = [n for n, _ in params] + [n for n, _ in buffers]
    forward_loc = _forward_location(model)
    reads = ConstantReads.when_asked()  # on only for a second trace: one more Python frame per op

    def joint(param_vals, buffer_vals, batch_vals, scale_vals):
        _record_stack_traces()
        for p in param_vals:  # as eager's zero_grad(set_to_none=True): only this backward's .grad counts
            p.grad = None
        state = dict(zip(names, list(param_vals) + list(buffer_vals)))
        keys = source.keys or ()
        with autocast(precision), reads.mode() as answered:
            args, kwargs = ((), dict(zip(keys, batch_vals))) if keys else (tuple(batch_vals), None)
            output = torch.func.functional_call(model, state, args, kwargs)
        loss = scalar_loss(output, source, forward_loc)
        # Makes autograd tag backward nodes with the seq_nr of their forward op.
        setup_stacktrace_preservation_hooks([loss.grad_fn])
        seed = loss * scale_vals[0] if scale_vals else loss
        grads = torch.autograd.grad(seed, list(param_vals), allow_unused=True)
        grads = [plus_accumulated(g, p) for g, p in zip(grads, param_vals)]
        return [answered.checks.apply(loss) if answered is not None else loss, *grads]

    def trace(stamper: Stamper | None) -> torch.fx.Graph:
        # a lazy GraphModule: nothing runs the traced module, and generating its Python code
        # (fx's recompile, ~1 ms per 30 nodes) would go unread
        # the module paths inside preserve_node_meta: a failed trace leaves their annotations
        # open (under is_compiling torch runs no always_call hook when forward raises), and
        # _module_paths closes them before the node meta they edit is restored
        with fx_traceback.preserve_node_meta(), _module_paths(model), _without_onednn(), \
                (stamper.active() if stamper else contextlib.nullcontext()), _FailedFakeKernel() as failed, \
                _use_lazy_graph_module(True), TorchFramesFilter().active(), _compiling(), no_reseeding():
            try:
                gm = make_fx(joint, tracing_mode="real")(  # stack traces: see _record_stack_traces
                    [p for _, p in params], [b for _, b in buffers], list(batch), scale)
            except SbpcError:
                raise
            except Exception as err:
                if not reads.retry(err):
                    raise _capture_error(err, source, failed.op) from err
                gm = None
        if gm is None:  # again with the reads answered; afresh, as a stamper keeps what it saw
            return trace(Stamper(stamper.repeated) if stamper else None)
        if stamper and reads.last is not None and reads.last.checks.checks:
            raise NotStampable  # a check read inside the traced layer would be missing from its copies
        return expand(gm, stamper, names) if stamper else gm.graph

    if repeated is None:
        graph = trace(None)
    else:
        try:
            graph = trace(Stamper(repeated))
        except NotStampable:
            graph = trace(None)  # layer 1 is not a template the copies can follow: trace them all
    plain_views(graph)
    return graph


def _record_stack_traces() -> None:
    """From here on, make_fx records each op's stack trace (which gives it the user's file:line),
    as ``make_fx(record_stack_traces=True)`` would from the start. The placeholders made before
    ``joint`` runs would get none anyway (the trace keeps only ``forward`` frames, and there is
    none yet), but each costs a full traceback: ~1,500 of them at 1T, ~0.1 s."""
    tracer = get_proxy_mode().tracer
    tracer.record_stack_traces = True
    tracer._record_forward_stack_traces_only = True  # as make_fx sets it with record_stack_traces


class TorchFramesFilter:
    """``symbolic_shapes.uninteresting_files()``, the torch files whose frames make_fx's
    stack-trace filter drops, listed without importing them: torch's own first call imports
    torch.export's tracer (with functorch's AOT autograd) and inductor's sizevars to name their
    files, ~0.1 s of a capture that uses neither. The same modules' files, found by their import
    specs, for the torch release whose list this is (tests/test_capture.py checks it against
    torch's); another release asks torch's own."""

    _TORCH = "2.13.0"
    _MODULES = ("torch", "torch._compile", "torch._dynamo.eval_frame", "torch._inductor.sizevars",
                "torch._library.custom_ops", "torch._library.fake_impl", "torch._logging._internal",
                "torch._logging.structured", "torch._subclasses.fake_tensor", "torch._subclasses.meta_utils",
                "torch.export._trace", "torch.fx._symbolic_trace", "torch.fx.experimental.recording",
                "torch.fx.experimental.sym_node", "torch.fx.experimental.symbolic_shapes", "torch.fx.interpreter")

    def __init__(self):
        self._files: set[str] | None = None

    def files(self) -> set[str]:
        if self._files is None:
            import torch._dynamo.guards  # loaded with FakeTensorMode, which imports dynamo's config

            higher_order_ops = os.path.dirname(importlib.util.find_spec("torch._higher_order_ops").origin)
            self._files = ({importlib.util.find_spec(m).origin for m in self._MODULES}
                           | set(glob.glob(os.path.join(higher_order_ops, "*.py")))
                           | torch._dynamo.guards.uninteresting_files() | {"<string>"})
        return self._files

    def active(self):
        if torch.__version__.split("+")[0] != self._TORCH:
            return contextlib.nullcontext()
        return mock.patch.object(symbolic_shapes, "uninteresting_files", self.files)


def _capture_error(err: Exception, source: ModelSource, op: str | None = None) -> CaptureError:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    data_dependent = "data-dependent" in str(err).lower() or "DataDependent" in type(err).__name__
    hint = ("control flow that depends on tensor values cannot be traced; use torch.where or move the decision "
            "out of forward()" if data_dependent else "forward() must be traceable by torch.fx / make_fx with fake tensors")
    if op is not None and "grouped_mm" in op:
        hint = ("a mixture-of-experts layer (tokens grouped by expert): sbpc does not support MoE layers yet "
                "(torch traces this op only in bf16, and its groups follow the routing's values)")
    what = "data-dependent control flow" if data_dependent else f"{type(err).__name__}: {text}"
    dynamic = isinstance(err, DynamicOutputShapeException)
    if dynamic:  # nonzero, masked_select, unique: a mixture of experts' routing, a CTC head's targets
        what = f"{err.func} makes a tensor whose shape depends on tensor values"
        hint = ("a plan's shapes are fixed at compile time; keep shapes static (torch.where, a mask, "
                "a fixed capacity) instead of selecting the elements")
    branch = _reading_line(err) if data_dependent or dynamic else None
    if branch is not None and branch != user_location(err, source.path):  # a library's line (a check of the labels)
        what += f" at {branch}"
    return CaptureError(f"cannot trace forward(): {what}" + (f" (in {op})" if op else ""),
                        location=user_location(err, source.path), hint=hint)


def _reading_line(err: Exception) -> str | None:
    """The line that read a tensor's value, as ``file:line``: the innermost frame of ``err``
    outside torch and sbpc."""
    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sbpc.compiler, sbpc.runtime))
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if not os.path.abspath(frame.filename).startswith(skip):
            return f"{display_path(frame.filename)}:{frame.lineno}"
    return None


class _FailedFakeKernel(logging.Filter):
    """While tracing: torch logs a fake kernel's failure, with its traceback, before raising it.
    The error becomes one line (``_capture_error``; the traceback is ``--debug``'s), so that
    record is kept from stderr, and the op it names goes into the line."""
    _LOGGER = "torch._subclasses.fake_tensor"

    def __init__(self):
        super().__init__()
        self.op: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.args:
            return True
        self.op = self.op or str(record.args[0])
        return False

    def __enter__(self) -> "_FailedFakeKernel":
        logging.getLogger(self._LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(self._LOGGER).removeFilter(self)


def _forward_location(model: torch.nn.Module) -> str | None:
    return function_location(type(model).forward)


@contextlib.contextmanager
def _compiling():
    """``torch.compiler.is_compiling()`` true while tracing, as under torch.export, whose tracer
    is make_fx too: libraries then keep traced values out of their caches. Hugging Face's
    ``compile_compatible_method_lru_cache`` (BEiT's relative position index) would otherwise
    keep a fake tensor of this trace for every later call in the process: eager's (``sbpc
    check``'s reference) and the next capture's. Not ``is_exporting()``, which torch.export
    sets too: under it Hugging Face builds an attention mask even where none is needed."""
    was = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = was


@contextlib.contextmanager
def _without_onednn():
    """oneDNN off while tracing: an LSTM then traces as its cell's ATen ops (as a GRU always
    does), which every backend runs and SBP can split, not as the CPU-only fused
    ``mkldnn_rnn_layer`` (eager's kernel: the two agree to float rounding). The switch behind
    ``torch.backends.mkldnn.enabled``, which refuses to be set once torch's test utilities froze
    the flags; its ``flags()`` context would also reset the other oneDNN flags, with a warning."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)


@contextlib.contextmanager
def _module_paths(model: torch.nn.Module):
    """Tag every traced op with the path of the module that ran it."""
    paths = {id(m): name for name, m in model.named_modules()}
    stack: list[contextlib.ExitStack] = []

    def pre(module, args):
        if id(module) in paths:
            es = contextlib.ExitStack()
            es.enter_context(fx_traceback.annotate({MODULE_KEY: paths[id(module)]}))
            stack.append((module, es))

    def post(module, args, out):
        if stack and stack[-1][0] is module:
            stack.pop()[1].close()

    handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
               torch.nn.modules.module.register_module_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while stack:
            stack.pop()[1].close()


@contextlib.contextmanager
def _module_output_hints(model: torch.nn.Module, config: ParallelConfig):
    """Pin the output (its first tensor) of every module a ``[modules]`` glob names."""
    handles = []
    for path, module in model.named_modules():
        hint = config.module_hint(path)
        if hint is None:
            continue

        def post(mod, args, out, hint=hint):
            if isinstance(out, torch.Tensor):
                return hint_op(out, hint)
            if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
                return (hint_op(out[0], hint), *out[1:])
            return out

        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()

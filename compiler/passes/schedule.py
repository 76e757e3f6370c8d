"""schedule: cut the program into pipeline actors and prove the firing order deadlock-free.

Micro-batching is a split of the batch over the compiler's ``mb`` axis, so after boxing a
value is per micro-batch (split or partial on ``mb``) or per step (``B`` on ``mb``), and the
only ``mb`` collectives are all-reduces. This pass gives them their sequential meaning:

- an ``mb`` all-reduce becomes ``sbpc.mb_accumulate`` on the chunk that makes its input. When
  its input comes out of the backward (a weight gradient), it and everything after it run
  once a step in the ``opt`` phase (gradient accumulation, then one optimizer step). When it
  sums a forward value the micro-batches need (the token count of a mean loss), the ops it
  reads become the ``pre`` phase, which runs for every micro-batch before any forward;
- a value read on another chunk gets an ``sbpc.transfer`` there, in the phase that first
  needs it: send/recv between matching ranks of the two stages. Boxing already placed SBP
  conversions at the consumer, so a tp-split activation crosses split and is gathered after
  receipt (Megatron's scatter/gather);
- a parameter used on several chunks (a tied embedding / lm-head) is updated by its owner
  (the chunk of its optimizer); the others receive the new value once a step. The gradient
  contributions meet at the owner before the update, so all copies stay identical;
- the loss and gradients leave the step accumulated over micro-batches.

Then the actor system of every device stage is simulated (``schedule_sim``); the firing order
it yields is replayed with the runtime's semantics (``pipeline_tasks.replay``), which raises
on any wait cycle, before it goes into the plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import networkx as nx
from typing import ClassVar

from sbpc.compiler.pass_manager import Fact
from sbpc.compiler.ir.types import DType, FreshNames, Graph, InputKind, Node, OutputKind, Ref, Role, producers, rename_uses, users
from sbpc.compiler.sbp.boxing_plan import SEQUENTIAL_STEPS
from sbpc.compiler.sbp.cost_model import AlphaBeta, CostModel
from sbpc.compiler.ir.mesh import MICROBATCH
from sbpc.compiler.pipelining.schedule_sim import Simulation, TaskCost, simulate
from sbpc.compiler.pipelining.whole_batch import gradient_of_a_batch_value_error, whole_batch_error
from sbpc.errors import CompileError, ModelError, PlanError
from sbpc.runtime.pipeline_tasks import ACCUMULATE, TRANSFER, Item, TaskGraph, replay
from sbpc.runtime.kinds import Collective, ScheduleName
from sbpc.runtime.plan import PipelineSpec, ReplicaUpdate, TaskRef
from sbpc.runtime.sbp import Broadcast, Split, local_shape

_SEQUENTIAL_OK = {k.op for k in SEQUENTIAL_STEPS}  # what may run over micro-batches
# the *_like factories of a backward seed, by the value they fill in (full_like: its argument)
_SEED_FILL = {"aten.ones_like.default": 1.0, "aten.zeros_like.default": 0.0, "aten.full_like.default": None}
_ORDER = {Role.PRE: 0, Role.FORWARD: 1, Role.BACKWARD: 2, Role.OPTIMIZER: 3}


@dataclass
class Schedule:
    name: str = "schedule"
    needs: ClassVar[tuple[Fact, ...]] = (Fact.STAGES, Fact.LOCAL)
    provides: ClassVar[tuple[Fact, ...]] = ()
    schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    virtual_stages: int = 1
    cost: TaskCost | None = None  # durations for the simulation; unit cost when None
    cost_model: CostModel = field(default_factory=AlphaBeta)  # prices a transfer whole or split

    def apply(self, graph: Graph, ctx) -> Graph:
        pp, m = graph.mesh.size("pp"), graph.mesh.microbatches
        if pp == 1 and m == 1:
            return graph
        graph = _Cutter(graph, self.cost_model).run()
        tg = task_graph(graph)
        sim = simulate(tg, self.schedule, pp, self.virtual_stages, self.cost)
        try:
            replay(tg, sim.order, lambda c: c % pp)
        except PlanError as err:
            raise CompileError(err.message, hint=err.hint) from None
        spec = PipelineSpec(
            schedule=self.schedule, microbatches=m, stages=pp, virtual_stages=self.virtual_stages,
            in_flight=sim.in_flight, order=[[TaskRef(chunk=t.chunk, phase=t.phase, mb=t.mb, part=t.part) for t in dev]
                                            for dev in sim.order],
            replicas=_replicas(graph), bubble=round(sim.bubble(), 6))
        scheduled = replace(graph, schedule=spec)
        scheduled._tasks = graph._tasks  # the same node and output lists: the same tasks (inplace asks first)
        return scheduled


def task_graph(graph: Graph) -> TaskGraph:
    """The runtime's tasks of ``graph``. Built once per graph: the verifier after each pass,
    inplace and memory-plan ask for it of the same graph (a 1T pipeline's takes ~0.2 s). It is
    kept on the graph with the node and output lists it came from; passes make new lists (and
    new nodes), never change them in place."""
    m = graph.mesh.microbatches
    cached = graph._tasks
    if cached is not None and cached[0] is graph.nodes and cached[1] is graph.outputs and cached[2] == m:
        return cached[3]
    items = [Item(i, n.op, tuple(n.outputs), tuple(n.uses()), n.role.value, n.stage or 0,
                  n.kwargs.get("src") if n.op == TRANSFER else None) for i, n in enumerate(graph.nodes)]
    outs = [o.value for o in graph.outputs]
    tg = TaskGraph(items, outs, m)
    graph._tasks = (graph.nodes, graph.outputs, m, tg)
    return tg


def node_tasks(graph: Graph) -> list[tuple[int, str, int]]:
    """The task (chunk, phase, part) of every node of a pipelined graph, as the runtime cuts them."""
    task: list = [None] * len(graph.nodes)
    for key, body in task_graph(graph).bodies.items():
        for it in (*body.kernels, *body.recvs, *body.reads):
            task[it.index] = key
    return task


def execution_positions(graph: Graph, tasks: list[tuple[int, str, int]] | None = None
                        ) -> list[tuple[int, tuple[int, int]]]:
    """Per node: its device stage and when it runs there, comparable within a stage. A one-program
    plan runs in graph order; a pipeline stage runs its tasks in ``schedule.order[stage]`` and a
    task's instructions in graph order, so a position is (the task's place in that order -- a
    per-micro-batch task's last firing --, the graph index)."""
    if graph.schedule is None:
        return [(0, (0, i)) for i in range(len(graph.nodes))]
    spec = graph.schedule
    place = {(t.chunk, t.phase, t.part): k for dev in spec.order for k, t in enumerate(dev)}
    tasks = tasks if tasks is not None else node_tasks(graph)
    return [(key[0] % spec.stages, (place[key], i)) for i, key in enumerate(tasks)]


def simulate_graph(graph: Graph, schedule: ScheduleName, virtual_stages: int, cost: TaskCost | None = None) -> Simulation:
    return simulate(task_graph(graph), schedule, graph.mesh.size("pp"), virtual_stages, cost)


class _Cutter:
    def __init__(self, graph: Graph, cost_model: CostModel | None = None):
        self.g = graph
        self.cost_model = cost_model or AlphaBeta()
        axes = graph.mesh.sbp_axes
        self.sizes = tuple(graph.mesh.size(a) for a in axes)
        self.mb = axes.index(MICROBATCH) if MICROBATCH in axes else None
        self.sbp = {i.value: i.sbp for i in graph.inputs}
        for n in graph.nodes:
            self.sbp.update(zip(n.outputs, n.sbp or []))
        self.producer = graph.producers()
        self.fresh = FreshNames(set(self.sbp) | set(self.producer))
        self._dag: nx.DiGraph | None = None  # see _ancestors

    def per_mb(self, v: str) -> bool:
        nd = self.sbp.get(v)
        return self.mb is not None and nd is not None and not isinstance(nd[self.mb], Broadcast)

    def run(self) -> Graph:
        nodes = self._phases(self._seeds_without_loss(list(self.g.nodes)))
        if self.mb is not None:  # one micro-batch: the update reads its values as they are
            nodes = self._step_values_for_optimizer(nodes)
        nodes, outputs = self._accumulate_outputs(nodes)
        nodes = self._transfers(nodes)
        nodes, outputs = self._replica_updates(nodes, outputs)
        return replace(self.g, nodes=nodes, outputs=outputs)

    def _seeds_without_loss(self, nodes: list[Node]) -> list[Node]:
        """The backward's seed ``ones_like(loss)`` reads only the loss's (0-d) shape, but as an
        operand it ties every micro-batch's backward to the loss. A loss that is whole on the
        micro-batch axis (``loss + 1.0``, ``0 + loss``: after the sum over micro-batches) is a
        once-a-step value, so that seed would pull the backward into the once-a-step phase, or
        the whole forward into the ``pre`` phase. There the seed becomes a constant; a seed of
        a per-micro-batch loss keeps its operand (plans unchanged)."""
        out = []
        for n in nodes:
            src = n.args[0] if n.op in _SEED_FILL and n.args else None
            if isinstance(src, Ref) and n.types[0].shape == () and src.name in self.producer \
                    and self.mb is not None and not self.per_mb(src.name):
                fill = n.args[1] if n.op == "aten.full_like.default" else _SEED_FILL[n.op]
                n = replace(n, op="sbpc.constant", args=([fill], []), kwargs={"dtype": DType(n.types[0].dtype)},
                            sbp_in=[])
            out.append(n)
        return out

    # ----- phases
    def _phases(self, nodes: list[Node]) -> list[Node]:
        for i, n in enumerate(nodes):
            if n.kwargs.get("axis") == MICROBATCH and n.op not in _SEQUENTIAL_OK:
                raise whole_batch_error(self.g, nodes, i, self.per_mb, self.sbp, self.mb)
        role = [n.role for n in nodes]
        ancestors_bwd = self._reaches_backward(nodes)
        readers = users(nodes)
        for i, n in enumerate(nodes):
            if not self._is_mb_reduce(n):
                continue
            x = n.args[0].name
            early = not ancestors_bwd.get(x, False) and self._feeds_micro_batches(nodes, readers, n.outputs[0])
            if early:
                for a in self._ancestors(nodes, x):
                    if nodes[a].role != Role.FORWARD:
                        raise CompileError(f"the sum over micro-batches of %{x} depends on the backward",
                                           location=str(nodes[a].loc) if nodes[a].loc else None)
                    role[a] = Role.PRE
                role[i] = Role.FORWARD
            else:
                role[i] = Role.OPTIMIZER
        # everything after a once-a-step value that is not per micro-batch runs once a step
        for i, n in enumerate(nodes):
            if n.role == Role.OPTIMIZER or any(role[self.producer[u]] == Role.OPTIMIZER
                                               for u in n.uses() if u in self.producer):
                if role[i] != Role.FORWARD or not self._is_mb_reduce(n):
                    role[i] = Role.OPTIMIZER
        out = []
        for i, n in enumerate(nodes):
            if role[i] == Role.OPTIMIZER and any(self.per_mb(o) for o in n.outputs):
                raise gradient_of_a_batch_value_error(n)
            n = n.replace(role=role[i])
            if self._is_mb_reduce(n):
                n = n.replace(op=ACCUMULATE, kwargs={"reduce": n.kwargs.get("reduce", "sum")},
                            stage=nodes[self.producer[n.args[0].name]].stage if n.args[0].name in self.producer else n.stage)
            out.append(n)
        return _stable_phase_sort(out)

    def _is_mb_reduce(self, n: Node) -> bool:
        return n.op == Collective.ALL_REDUCE.op and n.kwargs.get("axis") == MICROBATCH

    def _feeds_micro_batches(self, nodes: list[Node], readers: dict[str, list[int]], v: str) -> bool:
        """Whether a per-micro-batch value is computed from ``v`` (a sum over the micro-batches)
        through whole-step values only: directly (a mean loss's division by the token count) or
        after more conversions of the sum (its all-reduce over dp, which then runs per
        micro-batch too)."""
        todo, seen = [v], {v}
        while todo:
            for c in readers.get(todo.pop(), []):
                if nodes[c].role == Role.OPTIMIZER:
                    continue
                for o in nodes[c].outputs:
                    if self.per_mb(o):
                        return True
                    if o not in seen:
                        seen.add(o)
                        todo.append(o)
        return False

    def _reaches_backward(self, nodes: list[Node]) -> dict[str, bool]:
        out: dict[str, bool] = {}
        for n in nodes:
            hit = n.role in (Role.BACKWARD, Role.OPTIMIZER) or any(out.get(u, False) for u in n.uses())
            for o in n.outputs:
                out[o] = hit
        return out

    def _ancestors(self, nodes: list[Node], v: str) -> list[int]:
        """The ops ``v`` is computed from, itself included (program order)."""
        p = self.producer.get(v)
        if p is None:
            return []
        if self._dag is None:  # producer -> reader, built once, when a reduction first asks
            self._dag = nx.DiGraph()
            self._dag.add_nodes_from(range(len(nodes)))
            self._dag.add_edges_from((self.producer[u], i) for i, n in enumerate(nodes) for u in n.uses()
                                     if u in self.producer)
        return sorted(nx.ancestors(self._dag, p) | {p})

    def _step_values_for_optimizer(self, nodes: list[Node]) -> list[Node]:
        """The once-a-step phase recomputes the per-step values it reads from a micro-batch
        phase (positions, weight transposes, a summed count): the same in every micro-batch,
        so reading one of them would be right, but it would tie the optimizer to a firing."""
        producer = {v: nodes[i] for v, i in producers(nodes).items()}
        clones: dict[tuple[str, int], str] = {}
        out: list[Node] = []

        def clone(v: str, chunk: int, reader: Node) -> str:
            p = producer.get(v)
            if p is None or p.role == Role.OPTIMIZER:
                return v
            if self.per_mb(v):
                raise CompileError(f"{reader.op} runs once a step but reads %{v}, which differs per micro-batch",
                                   location=str(reader.loc) if reader.loc else None,
                                   hint="report this plan: the micro-batch split reached the optimizer")
            if (v, chunk) not in clones:
                uses = {u: clone(u, chunk, p) for u in dict.fromkeys(p.uses())} if p.op != ACCUMULATE else {}
                names = [self.fresh(f"{o}_step") for o in p.outputs]
                for o, name in zip(p.outputs, names):
                    clones[(o, chunk)] = name
                    self.sbp[name] = self.sbp.get(o)
                out.append(replace(_rename(p, uses), outputs=names, role=Role.OPTIMIZER, stage=chunk))
            return clones[(v, chunk)]

        for n in nodes:
            if n.role == Role.OPTIMIZER and n.op != ACCUMULATE:
                n = _rename(n, {u: clone(u, n.stage or 0, n) for u in dict.fromkeys(n.uses())})
            out.append(n)
        return out

    # ----- what leaves the step
    def _accumulate_outputs(self, nodes: list[Node]) -> tuple[list[Node], list]:
        acc = {n.args[0].name: n.outputs[0] for n in nodes if n.op == ACCUMULATE}
        producer = producers(nodes)
        outputs, extra = [], []
        for o in self.g.outputs:
            if o.kind in (OutputKind.LOSS, OutputKind.GRAD) and self.per_mb(o.value):
                if o.value not in acc:
                    src = nodes[producer[o.value]]
                    name = self.fresh(f"{o.value}_acc")
                    nd = tuple(Broadcast() if a == self.mb else s for a, s in enumerate(self.sbp[o.value]))
                    extra.append(Node([name], ACCUMULATE, (Ref(o.value),), {"reduce": "sum"}, [src.types[0]],
                                      Role.OPTIMIZER, loc=src.loc, stage=src.stage, sbp=[nd], sbp_in=[self.sbp[o.value]],
                                      why=f"the step's {o.kind.value} summed over micro-batches"))
                    acc[o.value] = name
                    self.sbp[name] = nd
                o = replace(o, value=acc[o.value])
            outputs.append(o)
        return nodes + extra, outputs

    # ----- cross-chunk values
    def _transfers(self, nodes: list[Node]) -> list[Node]:
        made_on = {o: (n.stage or 0, n) for n in nodes for o in n.outputs}
        moved: dict[tuple[str, int], str] = {}
        out: list[Node] = []
        for n in nodes:
            here = n.stage or 0
            renames = {}
            for u in dict.fromkeys(n.uses()):
                if u not in made_on or made_on[u][0] == here:
                    continue
                src_chunk, src = made_on[u]
                if (u, here) not in moved:
                    if src.role == Role.OPTIMIZER and n.role != Role.OPTIMIZER:
                        raise CompileError(f"%{u} is made once a step on chunk {src_chunk} but read per micro-batch on chunk {here}",
                                           location=str(n.loc) if n.loc else None)
                    t = src.types[src.outputs.index(u)]
                    nodes_, name = self._transfer(u, t, src, src_chunk, n, here)
                    out.extend(nodes_)
                    moved[(u, here)] = name
                    for m in nodes_:
                        made_on[m.outputs[0]] = (m.stage, m)
                renames[u] = moved[(u, here)]
            if renames:
                n = _rename(n, renames)
            out.append(n)
        return _stable_phase_sort(out)

    def _transfer(self, u: str, t, src: Node, src_chunk: int, reader: Node, here: int) -> tuple[list[Node], str]:
        """``u`` sent whole, or -- when the cost model says so -- cut along a device axis on
        which it is replicated, sent as 1/k, and all-gathered after receipt (Megatron's
        scatter/gather: the stage link carries bsh/t instead of bsh)."""
        nd = self.sbp.get(u)
        split = self._scatter_axis(t, nd) if nd is not None else None
        why = f"%{u} crosses from chunk {src_chunk} to chunk {here}"
        if split is None:
            name = self.fresh(f"{u}_from{src_chunk}")
            return [Node([name], TRANSFER, (Ref(u),), {"src": src_chunk, "dst": here}, [t], reader.role, loc=src.loc,
                         stage=here, sbp=[nd] if nd is not None else None, sbp_in=[nd] if nd is not None else None,
                         why=why)], name
        a, d = split
        cut = nd[:a] + (Split(d),) + nd[a + 1:]
        axis = self.g.mesh.sbp_axes[a]
        names = [self.fresh(f"{u}_scatter"), self.fresh(f"{u}_from{src_chunk}"), self.fresh(f"{u}_gather")]
        nodes = [
            Node([names[0]], Collective.SHARD_SLICE.op, (Ref(u),), {"axis": axis, "dim": d, "parts": 1}, [t], src.role,
                 loc=src.loc, stage=src_chunk, sbp=[cut], sbp_in=[nd], why=why + f", cut along {axis} to send 1/k"),
            Node([names[1]], TRANSFER, (Ref(names[0]),), {"src": src_chunk, "dst": here}, [t], reader.role,
                 loc=src.loc, stage=here, sbp=[cut], sbp_in=[cut], why=why),
            Node([names[2]], Collective.ALL_GATHER.op, (Ref(names[1]),), {"axis": axis, "dim": d, "parts": 1}, [t], reader.role,
                 loc=src.loc, stage=here, sbp=[nd], sbp_in=[cut], why=why + f", gathered along {axis} after receipt"),
        ]
        self.sbp.update({names[0]: cut, names[1]: cut, names[2]: nd})
        return nodes, names[2]

    def _scatter_axis(self, t, nd) -> tuple[int, int] | None:
        """The (axis, dim) to cut a transfer along, if that is cheaper than sending it whole."""
        local = local_shape(t.shape, nd, self.sizes)
        whole = t.local_nbytes(nd, self.sizes)
        best, best_cost = None, self.cost_model.transfer(whole)
        split_dims = {s.dim for s in nd if isinstance(s, Split)}
        for a, (name, k) in enumerate(zip(self.g.mesh.sbp_axes, self.sizes)):
            if name == MICROBATCH or k == 1 or not isinstance(nd[a], Broadcast):
                continue
            dims = [d for d in range(len(local)) if local[d] % k == 0 and d not in split_dims]
            if not dims:
                continue
            d = max(dims, key=lambda d: (local[d], d))
            cost = (self.cost_model.collective(Collective.SHARD_SLICE, whole, k) + self.cost_model.transfer(whole // k)
                    + self.cost_model.collective(Collective.ALL_GATHER, whole // k, k))
            if cost < best_cost:
                best, best_cost = (a, d), cost
        return best

    # ----- tied parameters
    def _replica_updates(self, nodes: list[Node], outputs) -> tuple[list[Node], list]:
        """A param (or a state: fp16's loss scale) read on chunks other than the one that updates
        it receives the new value."""
        updates = {o.name: o.value for o in outputs if o.kind == OutputKind.UPDATE}
        made_on = {v: nodes[i] for v, i in producers(nodes).items()}
        readers_of = {v: {nodes[i].stage or 0 for i in ix} for v, ix in users(nodes).items()}
        extra = []
        for b in self.g.inputs_of(InputKind.BUFFER):
            other = sorted(readers_of.get(b.value, set()) - {made_on[updates[b.name]].stage or 0}) \
                if updates.get(b.name) in made_on else []
            if other:  # its new value would have to reach those chunks after the forward: not modelled
                writer = made_on[updates[b.name]]
                raise ModelError(f"buffer {b.name!r} is updated by the forward on pipeline chunk {writer.stage or 0} "
                                 f"but also read on chunk {other[0]}, which is not supported yet",
                                 location=str(writer.loc) if writer.loc else None,
                                 hint="place the modules that read and update it on one stage ([stages] in the config)")
        for p in [*self.g.inputs_of(InputKind.PARAM), *self.g.inputs_of(InputKind.STATE)]:
            readers = sorted(readers_of.get(p.value, ()))
            new = updates.get(p.name)
            if new not in made_on:
                continue
            owner = made_on[new].stage or 0
            for c in readers:
                if c == owner:
                    continue
                name = self.fresh(f"{new}_to{c}")
                extra.append(Node([name], TRANSFER, (Ref(new),), {"src": owner, "dst": c}, [p.type], Role.OPTIMIZER,
                                  loc=made_on[new].loc, stage=c, sbp=[p.sbp] if p.sbp else None,
                                  sbp_in=[p.sbp] if p.sbp else None,
                                  why=f"{p.kind.value} {p.name} read on several chunks: the new value from its "
                                      f"owner, chunk {owner}"))
        return nodes + extra, outputs


def _replicas(graph: Graph) -> list[ReplicaUpdate]:
    params = {o.value: o.name for o in graph.outputs if o.kind == OutputKind.UPDATE}
    return [ReplicaUpdate(chunk=n.stage or 0, name=params[n.args[0].name], value=n.outputs[0])
            for n in graph.nodes if n.op == TRANSFER and n.role == Role.OPTIMIZER and n.args[0].name in params]


def _stable_phase_sort(nodes: list[Node]) -> list[Node]:
    """Program order with phases in firing order (pre, fwd, bwd, opt), each phase's nodes in
    their original relative order: every task's instructions stay topologically sorted."""
    return sorted(nodes, key=lambda n: _ORDER.get(n.role, 3))


def _rename(n: Node, renames: dict[str, str]) -> Node:
    return rename_uses(n, lambda u: renames.get(u, u))

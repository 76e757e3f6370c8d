"""The per-rank-role memory estimate: what each device holds at the peak of a step.

Everything comes from the IR after SBP (and, on pipelined meshes, after the schedule pass):
local shapes and dtypes of every value under its nd-SBP, which values alias one storage (view
ops), where each value dies, and the firing order of the stage's actors. The walk mirrors the
runtime exactly (`runtime/runner.py`, `runtime/pipeline.py`), so the estimate is the peak of
the run, not a formula:

- parameters, buffers and optimizer state are held for the whole step, and so are the old
  ones after a functional update has written the new ones, until the step returns; an update
  made in place (the ``inplace`` pass) writes over the old storage, so its result costs nothing;
- a one-program plan frees each value after its last use (a result nobody reads at once);
- a pipelined stage runs its tasks in the plan's order. A task's results that later tasks
  read stay in the micro-batch's environment until the micro-batch's last task on the stage
  (the regst); the stage's batch shards of every micro-batch are cut at the start of the step;
  received values join the environment; a value sent to another stage is kept by its send
  until the step ends (the runner waits for its sends then); the next task's receives are
  posted (their buffers allocated) before a task runs; an accumulated value (a weight
  gradient) is its first firing's result, and later ones are added into it in place when it
  is new storage that only the sum reads; otherwise the second is added out of place right
  after its task, later ones in place into that sum; inside a task, values die after their
  last use there, and a result nobody reads lives until the task returns.

What bytes each value holds, and under which term, is ``compiler/memory/storages.py``.

ZeRO (SBP of parameters and state), recompute (the graph), precision (dtypes) and optimizer
offload (the memory of a placement) change the IR, so the estimate follows them without knowing
about them. The walk counts one memory at a time: the device's (the roles' columns and total),
then, where the plan places anything there, the host's (``host``: the same walk over the values
in host memory, so the offloaded state, master copies and the update's own values at the host's
peak).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sbpc.compiler.memory.storages import TERMS, Storages, Term
from sbpc.compiler.ir.types import Graph, InputKind, Node, OutputKind, Role
from sbpc.runtime.kinds import ISSUE, WAIT, Collective, MemoryKind
from sbpc.runtime.pipeline_tasks import ACCUMULATE, Task, fmt
from sbpc.runtime.plan import RoleMemory

@dataclass
class _Peak:
    total: int = -1
    terms: dict[Term, int] = field(default_factory=dict)
    at: str = ""
    in_flight: int = 0

    def offer(self, total: int, terms: dict[Term, int], at: str, in_flight: int) -> None:
        if total > self.total:
            self.total, self.terms, self.at, self.in_flight = total, terms, at, in_flight


def _add_into(total: dict[Term, int], part: dict[Term, int], sign: int) -> None:
    for t, b in part.items():
        total[t] += sign * b


def _add(*parts: dict[Term, int]) -> dict[Term, int]:
    # summed part by part, not term by term over every part: called ~22k times at 1T
    out = dict.fromkeys(TERMS, 0)
    for p in parts:
        for t, b in p.items():
            out[t] += b
    return out


@dataclass
class _TaskProfile:
    """A task's own storages over its run: the peak of those it makes, by term."""
    peak: int
    terms: dict[Term, int]
    made: set[str]  # roots it allocates
    end: int  # bytes of its results when it returns (those that outlive it)
    end_terms: dict[Term, int]


def _task_profile(store: Storages, kernels: list[tuple[int, Node]], kept: set[str], outside: set[str],
                  unread_die_at_birth: bool) -> _TaskProfile:
    """Liveness inside one task. ``kept``: values that outlive it; ``outside``: roots already
    live when it starts (its inputs: views of them cost nothing)."""
    last = len(kernels)
    born: dict[str, int] = {}
    used: dict[str, int] = {}  # root -> last instruction that reads it
    for k, (_, n) in enumerate(kernels):
        for u in n.uses():
            r = store.root.get(u)
            if r is not None and r in born:
                used[r] = k
        for o in n.outputs:
            r = store.root[o]
            if r not in outside:
                born.setdefault(r, k)
    kept_roots = {store.root[v] for v in kept if v in store.root}
    end: dict[str, int] = {}
    for r, k in born.items():
        if r in kept_roots:
            end[r] = last  # outlives the task
        elif r in used:
            end[r] = used[r]
        else:  # nobody reads it: freed at once by the one-program runner, at return by a task
            end[r] = k if unread_die_at_birth else last
    births: dict[int, list[str]] = {}
    deaths: dict[int, list[str]] = {}
    for r, k in born.items():
        births.setdefault(k, []).append(r)
        deaths.setdefault(end[r], []).append(r)
    live: set[str] = set()
    b = best = 0
    best_terms = dict.fromkeys(TERMS, 0)
    terms = dict.fromkeys(TERMS, 0)  # the live bytes by term, kept as they change: a forward peaks at every op
    for k in range(last):
        new = births.get(k, ())
        live.update(new)
        b += store.nbytes(new)
        _add_into(terms, store.by_term(new, held=False), 1)
        staged = store.staging.get(id(kernels[k][1]), 0)
        if b + staged > best:
            best, best_terms = b + staged, _add(terms, {Term.BUFFERS: staged})
        gone = deaths.get(k, ())
        live.difference_update(gone)
        b -= store.nbytes(gone)
        _add_into(terms, store.by_term(gone, held=False), -1)
    return _TaskProfile(best, best_terms, set(born), b, store.by_term(live, held=True))


def _graph_output_values(graph: Graph) -> set[str]:
    return {o.value for o in graph.outputs}


@dataclass(frozen=True)
class Moment:
    """One task of a stage's walk: bytes held when it starts and the peak while it runs."""
    stage: int
    task: str
    held: int
    peak: int
    in_flight: int


def estimate_memory(graph: Graph, timeline: list[Moment] | None = None) -> list[RoleMemory]:
    """One ``RoleMemory`` per pp stage of ``graph`` (after SBP; after the schedule pass the
    pipeline's firing order and in-flight micro-batches are in it). ``timeline`` receives
    every task's ``Moment`` when given (the device's)."""
    roles = _estimate(graph, Storages(graph), timeline)
    if not any(i.memory == MemoryKind.HOST for i in graph.inputs) and not any(n.memory == MemoryKind.HOST
                                                                                 for n in graph.nodes):
        return roles
    host = _estimate(graph, Storages(graph, MemoryKind.HOST), None)
    return [r.model_copy(update={"host": h.total}) for r, h in zip(roles, host)]


def _estimate(graph: Graph, store: Storages, timeline: list[Moment] | None) -> list[RoleMemory]:
    state = _model_state(graph, store)
    sbp_devices = graph.mesh.world_size // graph.mesh.size("pp")  # the dp x tp ranks of a stage
    if graph.schedule is None:
        return [_one_program(graph, store, state[0], sbp_devices)]
    from sbpc.compiler.passes.schedule import task_graph  # the schedule pass's own task graph

    tg = task_graph(graph)
    # once, not per stage (64 at 1T, each reading ~100k graph inputs otherwise)
    acc_of = {n.args[0].name: n.outputs[0] for n in graph.nodes if n.op == ACCUMULATE}
    input_kind = {i.value: i.kind for i in graph.inputs}
    return [_pipelined_stage(graph, tg, store, acc_of, input_kind, s, state[s], sbp_devices, timeline)
            for s in range(graph.schedule.stages)]


def _model_state(graph: Graph, store: Storages) -> dict[int, tuple[int, int, int]]:
    """Per device stage: bytes of its parameters (and buffers), gradients and optimizer state."""
    pp = graph.schedule.stages if graph.schedule is not None else 1
    readers: dict[str, set[int]] = {}
    for n in graph.nodes:
        for u in n.uses():
            readers.setdefault(u, set()).add((n.stage or 0) % pp)
    made_on = {o: (n.stage or 0) % pp for n in graph.nodes for o in n.outputs}
    # one walk of the inputs and gradients, each added to the stages that read or make it (not a
    # walk per stage: 64 at 1T)
    params, states = [0] * pp, [0] * pp
    for i in graph.inputs:
        # optimizer state, and the learning rate the update reads (the optimizer column's too)
        column = params if i.kind in (InputKind.PARAM, InputKind.BUFFER) else \
            states if i.kind in (InputKind.STATE, InputKind.HYPER) else None
        if column is not None:
            for s in readers.get(i.value, ()):
                column[s] += store.store[i.value].nbytes
    grad_roots: list[set[str]] = [set() for _ in range(pp)]
    for o in graph.outputs_of(OutputKind.GRAD):
        if o.value in store.root:
            grad_roots[made_on.get(o.value, 0)].add(store.root[o.value])
    return {s: (params[s], store.nbytes(grad_roots[s]), states[s]) for s in range(pp)}


def _role(stage: int, pp: int, ranks: int, peak: _Peak, state: tuple[int, int, int]) -> RoleMemory:
    t = peak.terms
    return RoleMemory(role=f"stage {stage}", stage=stage, ranks=ranks,
                      params=t[Term.PARAMS], grads=t[Term.GRADS], optimizer=t[Term.OPTIMIZER],
                      activations=t[Term.ACTIVATIONS], buffers=t[Term.BUFFERS], temporaries=t[Term.TEMPORARIES],
                      total=peak.total, peak_at=peak.at, in_flight=peak.in_flight,
                      param_bytes=state[0], grad_bytes=state[1], optimizer_bytes=state[2])


def _one_program(graph: Graph, store: Storages, state, ranks: int) -> RoleMemory:
    """The Runner: every input held for the step; values die after their last use."""
    held = {store.root[i.value] for i in graph.inputs}
    prof = _task_profile(store, list(enumerate(graph.nodes)), _graph_output_values(graph), held,
                         unread_die_at_birth=True)
    peak = _Peak()
    base = store.by_term(held, held=True)
    peak.offer(store.nbytes(held) + prof.peak, _add(base, prof.terms), "step", 1)
    return _role(0, 1, ranks, peak, state)


def _pipelined_stage(graph: Graph, tg, store: Storages, acc_of: dict[str, str], input_kind: dict[str, InputKind],
                     stage: int, state, ranks: int, timeline: list[Moment] | None) -> RoleMemory:
    """``acc_of``: each accumulated value -> its ``mb_accumulate`` result; ``input_kind``: each
    graph input's value -> its kind."""
    spec = graph.schedule
    pp, m = spec.stages, spec.microbatches
    nodes = graph.nodes
    mine = {k: b for k, b in tg.bodies.items() if k[0] % pp == stage}
    order = [Task(t.chunk, t.phase, t.mb, t.part) for t in spec.order[stage]]
    inputs_here = {u for b in mine.values() for u in b.inputs}
    persistent: set[str] = set()
    batch: set[str] = set()
    for v in inputs_here:
        kind = input_kind.get(v)
        if kind is not None:
            (batch if kind == InputKind.BATCH else persistent).add(store.root[v])
    last_of_mb: dict[int, Task] = {}
    for t in order:
        if t.mb is not None:
            last_of_mb[t.mb] = t
    if m == 1:
        last_of_mb = {}  # one micro-batch: the update reads its values, nothing is dropped
    # a held storage is (root, micro-batch): one program value is a new tensor in every
    # micro-batch; None for what lives once a step
    persistent_keys = {(r, None) for r in persistent}
    step_env: set[tuple] = set()
    accs: set[tuple] = set()
    summed: set[tuple] = set()  # accumulators the runner allocated (a second firing's sum), added into in place
    pending: set[tuple] = set()  # sent to another stage: the send keeps it until the step ends
    profiles: dict[tuple, _TaskProfile] = {}
    started: set[int] = set()
    peak = _Peak()
    # the parameters and states are held through every task: their bytes are summed once; the
    # rest of what is kept across tasks is counted as it changes (a 1T stage holds ~10k storages)
    fixed_bytes, fixed_terms = _nbytes(store, persistent_keys), _by_term(store, persistent_keys)
    kept = _Kept(store, persistent_keys)
    env: list[set[tuple]] = [set() for _ in range(m)]
    for j in range(m):
        kept.join(env[j], {(r, j) for r in batch})
    for k, task in enumerate(order):
        body = mine[task.key]
        mb = task.mb
        here = env[mb] if mb is not None else step_env
        # step_env and accs as they stand before this task, not copied per task (~10k keys at
        # 1T): step_env grows in the task only where mb is None, when every key is once a step;
        # accs grows by fresh_accs
        fresh_accs: set[tuple] = set()

        def key(v: str) -> tuple:  # the storage key of v in this firing: once a step, or its micro-batch's
            once = (store.root[v], None)
            if once in persistent_keys or once in step_env or (once in accs and once not in fresh_accs):
                return once
            return (once[0], mb)

        kept.join(here, {key(it.outs[0]) for it in body.recvs})
        # the runner posts the next task's receives from other stages before this one runs
        # (gloo irecv into a buffer of its own): they are live during it
        nxt = order[k + 1] if k + 1 < len(order) else None
        ahead = {(store.root[it.outs[0]], nxt.mb) for it in mine[nxt.key].recvs if it.src % pp != stage} if nxt else set()
        flying = {x for xs in (pending, ahead) for x in xs if x not in persistent_keys and x not in kept.count}
        if task.key not in profiles:
            visible = {r for r, j in persistent_keys | kept.count.keys() | flying if j is None or j == mb or mb is None}
            kernels = [(it.index, nodes[it.index]) for it in body.kernels]
            profiles[task.key] = _task_profile(store, kernels, set(body.outputs), visible, unread_die_at_birth=False)
        prof = profiles[task.key]
        if mb is not None and task.phase == "fwd":
            started.add(mb)
        in_flight = len(started)  # forwards run whose micro-batch is not done on this stage
        base = fixed_bytes + kept.nbytes + _nbytes(store, flying)
        if timeline is not None:
            timeline.append(Moment(stage, fmt(task), base, base + prof.peak, in_flight))
        between = _add(fixed_terms, kept.terms, {Term.BUFFERS: _nbytes(store, flying)})  # held across tasks
        terms = _add(between, prof.terms)
        peak.offer(base + prof.peak, terms, fmt(task), in_flight)
        # the runner accumulates after the task, its results still in the environment: a first
        # firing's result becomes the accumulator (one storage, held once a step from now on);
        # later ones are added into it in place where it is new storage nothing else reads
        # (tg.owned), else the second out of place (the old and the new sum alive together, one
        # at a time) and the later ones into that new sum in place
        firsts = {o for o in body.outputs if o in acc_of and (store.root[acc_of[o]], None) not in accs}
        seconds = [o for o in body.outputs if o in acc_of and o not in firsts and o not in tg.owned
                   and (store.root[acc_of[o]], None) not in summed]
        adds = [store.store[store.root[acc_of[o]]].nbytes for o in seconds]
        summed |= {(store.root[acc_of[o]], None) for o in seconds}
        if adds:
            peak.offer(base + prof.end + max(adds), _add(between, prof.end_terms, {Term.GRADS: max(adds)}), fmt(task),
                       in_flight)
        kept.join(here, {key(o) for o in body.outputs if o not in firsts})
        acc_keys = {(store.root[acc_of[o]], None) for o in body.outputs if o in acc_of}
        fresh_accs.update(acc_keys - accs)
        kept.join(accs, acc_keys)
        pending |= {key(x.value) for x in tg.sends.get(task.key, []) if x.dst_chunk % pp != stage}
        if mb is not None and last_of_mb.get(mb) == task:
            kept.leave(env[mb])
            env[mb] = set()  # the micro-batch's regst is free
            started.discard(mb)
    return _role(stage, pp, ranks, peak, state)


class _Kept:
    """What a pipelined stage keeps across tasks besides ``skip`` (its parameters and states):
    the union of its environments (per micro-batch, once a step, accumulators), one key may be
    in several. Its bytes and bytes by term are updated as the sets change, not summed anew
    for every task."""

    def __init__(self, store: Storages, skip: set[tuple]):
        self.store, self.skip = store, skip
        self.count: dict[tuple, int] = {}  # key -> how many of the sets hold it
        self.nbytes = 0
        self.terms = dict.fromkeys(TERMS, 0)

    def join(self, target: set[tuple], keys: set[tuple]) -> None:
        """``target |= keys``, counted."""
        new = keys - target
        target |= new
        self._change(new, 1)

    def leave(self, source: set[tuple]) -> None:
        """``source`` is emptied: its keys leave."""
        self._change(source, -1)

    def _change(self, keys, step: int) -> None:
        # attributes held in locals: ~33k calls over ~10k keys each at 1T
        skip, count, store, terms = self.skip, self.count, self.store.store, self.terms
        edge = 1 if step > 0 else 0  # its first holder came, or its last one left
        nbytes = 0
        for k in keys:
            if k in skip:
                continue
            c = count.get(k, 0) + step
            if c:
                count[k] = c
            else:
                del count[k]
            if c == edge:
                s = store[k[0]]
                nbytes += step * s.nbytes
                terms[s.held_term] += step * s.nbytes
        self.nbytes += nbytes


def _nbytes(store: Storages, keys: set[tuple]) -> int:
    return sum(store.store[r].nbytes for r, _ in keys)


def _by_term(store: Storages, keys: set[tuple]) -> dict[Term, int]:
    return store.by_term([r for r, _ in keys], held=True)


def saved_for_backward(graph: Graph, depth: int = 2) -> dict[str, int]:
    """Bytes per device of the forward values each module's backward reads, by the module path's
    first ``depth`` components (``h.3``): the activations a layer keeps for its backward. A
    conversion in the backward (a kept value gathered again) counts for the op it converts for,
    not for the module that made the value (whose location it carries)."""
    store = Storages(graph)
    users = graph.users()
    nodes = graph.nodes

    def module(i: int) -> str | None:
        n = nodes[i]
        while (Collective.of(n.op) is not None or n.op in (ISSUE, WAIT)) and users.get(n.outputs[0]):
            n = nodes[users[n.outputs[0]][0]]
        return n.loc.module if n.loc else None

    out: dict[str, set[str]] = {}
    for i, n in enumerate(nodes):
        if n.role != Role.BACKWARD or not module(i):
            continue
        key = ".".join(module(i).split(".")[:depth])
        for u in n.uses():
            r = store.root.get(u)
            if r is not None and store.store[r].held_term == Term.ACTIVATIONS:
                out.setdefault(key, set()).add(r)
    return {k: store.nbytes(v) for k, v in out.items()}


def fits(roles: list[RoleMemory], budget: int | None) -> bool:
    return budget is None or all(r.total <= budget for r in roles)

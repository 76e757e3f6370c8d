"""The cuda backend (runtime/cuda.py, runtime/nccl.py, runtime/nccl_setup.py).

Without a GPU (CI, this machine): `--backend cuda` is refused in one line with exit 2, and the
parts that need neither CuPy nor a GPU run: the NCCL dtype table, which communicators exist and
the order every rank makes them in, the unique-id exchange over a real TCPStore, the watchdog,
the `[cuda]` extra. The tests marked ``cuda`` need a GPU and skip, with the reason, without one.
"""
from __future__ import annotations

import argparse
import ctypes
import threading
import time
import tomllib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, compile_example, sbpc
from sbpc.errors import PlanError, RuntimeFailure, UsageError
from sbpc.runtime.nccl_setup import (ID_KEY, NCCL_OPS, NCCL_TYPES, CommSpec, NcclEnum, Watchdog, all_gather_layout,
                                     all_to_all_layout, communicator_specs, decode_id, encode_id, exchange_unique_id,
                                     mine, nccl_type, reduce_scatter_layout)
from sbpc.runtime.topology import Topology

HAS_GPU = torch.cuda.is_available()
no_gpu = pytest.mark.skipif(HAS_GPU, reason="the refusal is for machines without a GPU")
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory):
    from sbpc.runtime.plan import save_plan

    path = tmp_path_factory.mktemp("cuda") / "mlp.json"
    save_plan(compile_example("mlp.py")[0].plan, str(path))
    return str(path)


# --- without a GPU: one line, exit 2 --------------------------------------------------------

@no_gpu
def test_sbpc_run_backend_cuda_without_a_gpu_is_one_line_exit_2(mlp_plan):
    proc = sbpc("run", mlp_plan, "--backend", "cuda", "--steps", "1", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--backend cuda needs an NVIDIA GPU" in lines[0] and "sees none" in lines[0]
    assert "hint:" in lines[0] and ".[cuda]" in lines[0] and "--backend cpu" in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@no_gpu
def test_sbpc_run_console_script_refuses_cuda_too(mlp_plan, capsys):
    from sbpc.runtime.cli import main

    assert main([mlp_plan, "--backend", "cuda", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--backend cuda needs an NVIDIA GPU" in err[0]


@no_gpu
def test_sbpc_check_backend_cuda_is_refused_before_compiling(capsys, monkeypatch):
    import sbpc.cli as cli

    def no_compile(args):
        raise AssertionError("compiled before refusing")

    monkeypatch.setattr(cli, "_compile", no_compile)
    assert cli.main(["check", "examples/mlp.py", "--backend", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--backend cuda needs an NVIDIA GPU" in err[0]


@no_gpu
def test_multi_rank_cuda_is_refused_before_cupy_is_asked_for():
    from sbpc.runtime.cli import check_backend

    with pytest.raises(UsageError, match="needs an NVIDIA GPU"):
        check_backend("cuda", 4)


def test_unknown_backend_names_the_known_ones():
    from sbpc.runtime.cli import check_backend

    with pytest.raises(UsageError, match=r"backend 'rocm' is not available; hint: available: cpu, cuda"):
        check_backend("rocm", 1)


def test_sbpc_check_refuses_rank_threads_on_cuda(capsys, monkeypatch):
    import sbpc.cli as cli

    monkeypatch.setattr(cli, "_compile", lambda args: pytest.fail("compiled before refusing"))
    assert cli.main(["check", "examples/mlp.py", "--backend", "cuda", "--ranks", "threads"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ranks threads runs on the cpu backend only, not cuda" in err[0]


def test_rank_threads_refuse_cuda():
    from sbpc.runtime.thread_launch import launch_threads

    def target(payload):
        from sbpc.runtime.dist import init_distributed

        return init_distributed([("dp", 2)], timeout=5, backend="cuda")

    with pytest.raises(UsageError, match="rank threads run on the cpu backend only"):
        launch_threads(2, target, {}, timeout=10)


@no_gpu
def test_gpu_check_fails_loudly_without_a_gpu(monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr("sys.argv", ["gpu_check.py"])
    assert gpu_check.main() == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"gpu_check: FAIL: no CUDA GPU visible to torch {torch.__version__} (CUDA build: none); "
                   "this check needs one GPU and a CUDA build of torch"]


def test_gpu_check_counts_model_flops_as_megatron_does():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    cfg = dict(layers=24, hidden=2048, vocab=51200, seq=2048)
    params = 12 * 24 * 2048 ** 2  # the layers' weights, without embeddings
    # 6 N tokens for the matmuls of the layers, plus attention and the logits (Narayanan et al. 2021, eq. 3)
    want = 6 * params * 8 * 2048 * (1 + 2048 / (6 * 2048) + 51200 / (12 * 24 * 2048))
    assert gpu_check.model_flops(cfg, 8) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("dtype,mask,kernel", [(torch.float32, False, "efficient"), (torch.bfloat16, False, "flash"),
                                               (torch.bfloat16, True, "efficient"), (torch.float16, False, "flash")])
def test_attention_kernels_call_torchs_ops_with_their_schemas(monkeypatch, dtype, mask, kernel):
    """On meta tensors (no GPU): the calls bind to the real ATen schemas, pick the kernel by the
    same rule forward and backward, and give the shapes the plan expects."""
    from sbpc.runtime import cuda

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    picked = []

    class Spy:  # stands for torch.ops.aten in runtime/cuda.py, noting which attention it calls
        def __getattr__(self, name):
            real = getattr(torch.ops.aten, name)
            if "_scaled_dot_product_" not in name:
                return real
            kind = "flash" if "flash" in name else "efficient"

            def call(*a, **k):
                picked.append(kind)
                return real.default(*a, **k)

            return type("Op", (), {"default": staticmethod(call)})

    monkeypatch.setattr(cuda, "aten", Spy())
    q, k, v = (torch.empty(2, 4, 40, 16, device="meta", dtype=dtype) for _ in range(3))
    m = torch.ones(40, 40, dtype=torch.bool, device="meta").tril() if mask else None
    out, lse = cuda.attention(q, k, v, 0.0, not mask, attn_mask=m)
    grads = cuda.attention_backward(torch.empty_like(out), q, k, v, out, lse, 0.0, not mask, attn_mask=m)
    assert picked == [kernel, kernel]
    assert out.shape == q.shape and lse.shape[:3] == (2, 4, 40 if kernel == "flash" else 64)  # efficient pads to 32
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    with pytest.raises(PlanError, match=r"attention dropout \(p=0.1\) on the cuda backend"):
        cuda.attention(q, k, v, 0.1, True)


# --- the dtype table ------------------------------------------------------------------------

# ncclDataType_t in nccl.h: a second statement of it, not a copy of the table's own lookups
NCCL_H = {"NCCL_INT8": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_UINT32": 3, "NCCL_INT64": 4, "NCCL_UINT64": 5,
          "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9}


def test_every_dtype_maps_to_nccl_h():
    assert nccl_type(torch.bfloat16).name == "NCCL_BFLOAT16" and nccl_type(torch.float16).name == "NCCL_FLOAT16"
    assert nccl_type(torch.float32).value == 7 and nccl_type(torch.int64).value == 4
    for dtype, enum in NCCL_TYPES.items():
        assert NCCL_H[enum.name] == enum.value, dtype
        # the element size NCCL moves is the tensor's
        width = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}[enum.value]
        assert torch.empty((), dtype=dtype).element_size() == width, dtype
    assert (NCCL_OPS["sum"].value, NCCL_OPS["max"].value) == (0, 2)  # ncclSum, ncclMax


def test_a_cupy_without_bfloat16_gets_nccl_h_value():
    class OldCupy:
        NCCL_FLOAT32 = 7

    class NewCupy:
        NCCL_BFLOAT16 = 9

    assert nccl_type(torch.bfloat16).resolve(OldCupy) == 9
    assert nccl_type(torch.bfloat16).resolve(NewCupy) == 9
    assert NcclEnum("NCCL_FLOAT32", 7).resolve(OldCupy) == 7


def test_unsupported_dtypes_and_reductions_are_named():
    with pytest.raises(PlanError, match=r"NCCL cannot move torch.complex64 tensors; hint: supported: int8"):
        nccl_type(torch.complex64)
    with pytest.raises(PlanError, match="a sum of bool tensors"):
        nccl_type(torch.bool, "sum")
    assert nccl_type(torch.bool, "max").name == "NCCL_UINT8"
    with pytest.raises(PlanError, match="unknown reduction 'prod'"):
        nccl_type(torch.float32, "prod")


# --- which communicators, in which order ---------------------------------------------------

def test_communicators_of_a_dp_tp_mesh_in_one_order_on_every_rank():
    axes = (("dp", 2), ("tp", 2))
    specs = communicator_specs(Topology(axes, 0))
    assert [(s.axis, s.ranks) for s in specs] == [("dp", (0, 2)), ("dp", (1, 3)), ("tp", (0, 1)), ("tp", (2, 3))]
    assert all(communicator_specs(Topology(axes, r)) == specs for r in range(4))  # the global list is rank-free
    assert [s.ranks for s in mine(specs, 3)] == [(1, 3), (2, 3)]
    assert specs[0].key == "axis-dp/0-2" and specs[0].what == "mesh axis dp (ranks (0, 2))"


def test_axes_of_one_rank_make_no_communicator_and_a_group_is_made_once():
    assert communicator_specs(Topology((("dp", 1), ("tp", 1)), 0)) == []
    assert communicator_specs(Topology((), 0)) == []
    assert [s.ranks for s in communicator_specs(Topology((("dp", 4), ("tp", 1)), 2))] == [(0, 1, 2, 3)]


def test_pipeline_pairs_go_one_way_each():
    axes = (("pp", 2), ("dp", 2))  # pp outermost: stage 0 = ranks 0, 1
    specs = communicator_specs(Topology(axes, 0))
    assert [(s.axis, s.ranks) for s in specs] == [
        ("dp", (0, 1)), ("dp", (2, 3)),  # no collective communicator over pp
        (None, (0, 2)), (None, (2, 0)), (None, (1, 3)), (None, (3, 1))]
    assert [s.ranks for s in mine(specs, 2)] == [(2, 3), (0, 2), (2, 0)]
    assert CommSpec((2, 0), None).what == "transfer rank 2 -> rank 0" and CommSpec((2, 0), None).key == "p2p/2-0"


def test_creation_order_cannot_wait_in_a_cycle():
    """Simulate ncclCommInitRank (blocks until every member called it) with every rank taking
    its communicators in ``mine`` order: all complete, on a mesh with every kind of group."""
    axes = (("pp", 2), ("dp", 2), ("tp", 3))
    topo = Topology(axes, 0)
    queues = {r: list(mine(communicator_specs(topo), r)) for r in range(topo.world_size)}
    made = 0
    while any(queues.values()):
        heads = {r: q[0] for r, q in queues.items() if q}
        ready = [s for s in set(heads.values()) if all(heads.get(m) == s for m in s.ranks)]
        assert ready, f"ranks wait in a cycle: {heads}"
        for s in ready:
            for m in s.ranks:
                queues[m].pop(0)
            made += 1
    assert made == len(communicator_specs(topo))


# --- layouts around NCCL's flat buffers, against the Communicator's contract --------------

def _members(n, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather_layout_gives_the_concatenation_in_group_order(dim):
    xs = _members(3, (4, 6, 2))
    lays = [all_gather_layout(x, 3, dim) for x in xs]
    flat = torch.cat([lay.src.reshape(-1) for lay in lays])  # ncclAllGather: the members' buffers in rank order
    for lay in lays:
        assert torch.equal(lay.finish(flat.reshape(lay.out_shape)), torch.cat(xs, dim=dim))


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_reduce_scatter_layout_gives_this_members_chunk_of_the_sum(dim):
    n = 2
    xs = _members(n, (4, 6, 2), seed=1)
    lays = [reduce_scatter_layout(x, n, dim) for x in xs]
    total = sum(lay.src.reshape(-1) for lay in lays)  # ncclReduceScatter: block i of the sum to rank i
    count = total.numel() // n
    for i, lay in enumerate(lays):
        got = lay.finish(total[i * count:(i + 1) * count].reshape(lay.out_shape))
        assert torch.equal(got, sum(xs).chunk(n, dim=dim)[i])


@pytest.mark.parametrize("split_dim,concat_dim", [(0, 1), (1, 0), (2, 1), (1, 1)])
def test_all_to_all_layout_sends_chunk_j_to_member_j(split_dim, concat_dim):
    n = 3
    xs = _members(n, (6, 3, 9), seed=2)
    lays = [all_to_all_layout(x, n, split_dim, concat_dim) for x in xs]
    for i, lay in enumerate(lays):
        # member i's buffer: block j is what member j sent to i, its block i (grouped send/recv)
        recv = torch.cat([lays[j].src.reshape(n, -1)[i] for j in range(n)]).reshape(lay.out_shape)
        want = torch.cat([x.chunk(n, dim=split_dim)[i] for x in xs], dim=concat_dim)
        assert torch.equal(lay.finish(recv), want)


# --- the unique id over a real TCPStore ----------------------------------------------------

def test_unique_id_round_trips_in_both_of_cupys_forms():
    uid = tuple(range(-128, 128, 2))  # older CuPy: 128 signed chars
    assert len(encode_id(uid)) == 129 and decode_id(encode_id(uid)) == uid
    other = tuple((7 * i) % 256 - 128 for i in range(128))
    assert decode_id(encode_id(other)) == other
    raw = bytes(range(128))  # newer CuPy: bytes
    assert decode_id(encode_id(raw)) == raw and isinstance(decode_id(encode_id(raw)), bytes)


def _store(world: int):
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _client(master):
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))


def test_unique_id_exchange_over_a_tcpstore():
    """Three ranks (threads, each with its own store client) exchange the ids of every
    communicator they belong to, in ``mine`` order; every member gets its leader's id."""
    master = _store(4)
    topo_axes = (("dp", 2), ("tp", 2))
    made = {}

    def make_id_for(rank):
        def make():
            uid = tuple(((rank * 31 + i) % 256) - 128 for i in range(128))
            made.setdefault(rank, []).append(uid)
            return uid
        return make

    got: dict[int, list] = {}
    errors = []

    def rank_main(rank):
        try:
            store = _client(master)
            specs = mine(communicator_specs(Topology(topo_axes, rank)), rank)
            got[rank] = [(s, exchange_unique_id(store, s, rank, make_id_for(rank), timeout=10)) for s in specs]
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for rank, pairs in got.items():
        for spec, uid in pairs:
            leader = spec.ranks[0]
            assert uid in made[leader], (rank, spec)
    assert got[3][0][1] == got[1][0][1] != got[0][0][1]  # dp group (1, 3) shares rank 1's id
    assert master.check([ID_KEY.format("axis-tp/2-3")])


def test_unique_id_wait_names_a_silent_leader():
    master = _store(2)
    spec = CommSpec((0, 1), "dp")
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"NCCL setup of mesh axis dp \(ranks \(0, 1\)\) failed on rank 1: "
                                             r"no unique id from rank 0 within 0.3s \(it hung or died\)") as info:
        exchange_unique_id(_client(master), spec, 1, lambda: pytest.fail("only the leader makes the id"),
                           timeout=0.3, poll=0.02)
    assert time.monotonic() - start < 5
    assert info.value.peer == 0 and info.value.secondary and info.value.timed_out


def test_unique_id_wait_names_a_failed_leader():
    master = _store(2)
    master.set("sbpc/failed/0", "ModelError: bad model file")
    with pytest.raises(RuntimeFailure, match="failed on rank 1: rank 0 failed: ModelError: bad model file"):
        exchange_unique_id(_client(master), CommSpec((0, 1), "tp"), 1, tuple, timeout=10, poll=0.02)


# --- the watchdog ---------------------------------------------------------------------------

class FakeWork:
    def __init__(self, spec, op, started, finished=False):
        self.spec, self.op, self.started, self.finished = spec, op, started, finished

    def done(self):
        return self.finished


def _watchdog(**kw):
    calls = []
    clock = [100.0]
    dog = Watchdog(0, 30.0, abort=lambda: calls.append("abort"), clock=lambda: clock[0], **kw)
    return dog, calls, clock


def test_watchdog_names_the_peer_of_a_stuck_collective_and_aborts():
    dog, calls, clock = _watchdog()
    dog.track(FakeWork(CommSpec((0, 1), "dp"), "all_reduce", started=100.0))
    clock[0] = 129.0
    assert dog.check_once() is None and calls == []
    clock[0] = 131.0
    err = dog.check_once()
    assert "all_reduce over mesh axis dp (ranks (0, 1)) failed on rank 0: no answer from rank 1 within 30s" in str(err)
    assert calls == ["abort"] and err.peer == 1 and err.timed_out
    with pytest.raises(RuntimeFailure, match="no answer from rank 1"):
        dog.track(FakeWork(CommSpec((0, 1), "dp"), "all_gather", started=131.0))  # the next call raises
    assert dog.picked_up


def test_watchdog_forgets_finished_work_and_names_a_failed_peer():
    failed = {}
    dog, calls, clock = _watchdog(peer_failure=lambda ranks: next(((r, failed[r]) for r in ranks if r in failed), None))
    done = FakeWork(CommSpec((0, 1), "dp"), "all_reduce", started=0.0, finished=True)
    dog.track(done)
    assert dog.check_once() is None and not dog.pending  # finished long ago: not a hang
    dog.track(FakeWork(CommSpec((0, 2, 4), "tp"), "reduce_scatter", started=100.0))
    assert dog.check_once() is None
    failed[4] = "RuntimeFailure: CUDA out of memory"
    assert dog.check_once() is None  # pending for less than a second: the store is not asked yet
    clock[0] = 101.5
    err = dog.check_once()
    assert "reduce_scatter over mesh axis tp (ranks (0, 2, 4)) failed on rank 0: rank 4 failed: " \
           "RuntimeFailure: CUDA out of memory" in str(err)
    assert calls == ["abort"] and err.peer == 4


def test_watchdog_reports_nccl_async_errors_and_a_group_timeout_names_all_peers():
    dog, calls, clock = _watchdog(async_error=lambda: "remote process exited or there was a network error")
    dog.track(FakeWork(CommSpec((0, 1), None), "send of %x", started=100.0))
    assert "send of %x over transfer rank 0 -> rank 1 failed on rank 0: NCCL: remote process exited" in str(dog.check_once())
    dog, calls, clock = _watchdog()
    dog.track(FakeWork(CommSpec((0, 1, 2), "dp"), "all_gather", started=100.0))
    clock[0] = 200.0
    assert "no answer from one of ranks (1, 2) within 30s" in str(dog.check_once())


def test_watchdog_thread_ends_a_process_the_abort_did_not_free():
    stuck = []
    dog = Watchdog(0, 0.05, abort=lambda: None, on_stuck=stuck.append, poll=0.01, grace=0.05)
    dog.start()
    dog.track(FakeWork(CommSpec((0, 1), "dp"), "all_reduce", started=time.monotonic()))
    deadline = time.monotonic() + 5
    while not stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    assert stuck and "no answer from rank 1" in str(stuck[0])


# --- the whole NcclCommunicator over a fake NCCL (threads as ranks, CPU memory) -----------
# What this covers: the communicator's own logic (which communicator a call uses, the NCCL
# ranks and counts it passes, the layouts, grouped sends, pairs per direction) on CPU. What it
# cannot: CuPy's real signatures, CUDA streams and events (faked as no-ops), NCCL itself.

class FakeFabric:
    """NCCL's semantics on host memory: communicators meet by unique id; a collective waits for
    every member's call with the same sequence number; sends go to a mailbox per (comm, src, dst)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.members: dict[tuple, dict[int, "FakeHandle"]] = {}
        self.calls: dict[tuple, dict[int, tuple]] = {}
        self.mail: dict[tuple, list] = {}


DTYPE_OF = {e.value: d for d, e in NCCL_TYPES.items() if d != torch.bool}


def _read(ptr, count, dtype):
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(bytearray(ctypes.string_at(ptr, nbytes)), dtype=dtype).clone()


def _write(ptr, t):
    data = t.contiguous().view(torch.uint8).numpy().tobytes()
    ctypes.memmove(ptr, data, len(data))


class FakeHandle:
    def __init__(self, fabric, n, uid, rank):
        self.fabric, self.n, self.uid, self.rank, self.seq = fabric, n, tuple(uid), rank, 0
        self.grouped = None
        with fabric.cond:  # ncclCommInitRank: blocks until every member called it
            fabric.members.setdefault(self.uid, {})[rank] = self
            fabric.cond.notify_all()
            assert fabric.cond.wait_for(lambda: len(fabric.members[self.uid]) == n, timeout=10), "init never met"

    def _meet(self, what, payload):
        key = (self.uid, self.seq, what)
        self.seq += 1
        f = self.fabric
        with f.cond:
            f.calls.setdefault(key, {})[self.rank] = payload
            f.cond.notify_all()
            assert f.cond.wait_for(lambda: len(f.calls[key]) == self.n, timeout=10), f"{what} never met"
            return dict(f.calls[key])

    def allReduce(self, send, recv, count, dtype, op, stream):
        parts = self._meet("allReduce", _read(send, count, DTYPE_OF[dtype]))
        stacked = torch.stack([parts[r] for r in range(self.n)])
        _write(recv, stacked.sum(0) if op == 0 else stacked.amax(0))

    def allGather(self, send, recv, count, dtype, stream):
        parts = self._meet("allGather", _read(send, count, DTYPE_OF[dtype]))
        _write(recv, torch.cat([parts[r] for r in range(self.n)]))

    def reduceScatter(self, send, recv, count, dtype, op, stream):
        parts = self._meet("reduceScatter", _read(send, count * self.n, DTYPE_OF[dtype]))
        total = torch.stack([parts[r] for r in range(self.n)]).sum(0)
        _write(recv, total[self.rank * count:(self.rank + 1) * count])

    def send(self, send, count, dtype, peer, stream):
        item = ("send", _read(send, count, DTYPE_OF[dtype]), peer)
        if self.grouped is not None:
            self.grouped.append(item)
        else:
            self._post(*item[1:])

    def recv(self, recv, count, dtype, peer, stream):
        item = ("recv", (recv, count, dtype), peer)
        if self.grouped is not None:
            self.grouped.append(item)
        else:
            self._take(*item[1:])

    def _post(self, data, peer):
        with self.fabric.cond:
            self.fabric.mail.setdefault((self.uid, self.rank, peer), []).append(data)
            self.fabric.cond.notify_all()

    def _take(self, where, peer):
        recv, count, dtype = where
        box = (self.uid, peer, self.rank)
        with self.fabric.cond:
            assert self.fabric.cond.wait_for(lambda: self.fabric.mail.get(box), timeout=10), "recv never matched"
            data = self.fabric.mail[box].pop(0)
        assert data.numel() == count and data.dtype == DTYPE_OF[dtype], "send and recv disagree"
        _write(recv, data)

    def flush(self):
        items, self.grouped = self.grouped, None
        for kind, payload, peer in items:  # a group call: every send first, then the receives
            if kind == "send":
                self._post(payload, peer)
        for kind, payload, peer in items:
            if kind == "recv":
                self._take(payload, peer)

    def abort(self):
        pass

    def destroy(self):
        pass

    def check_async_error(self):
        pass


class FakeNccl:
    """The slice of ``cupy.cuda.nccl`` the communicator calls."""
    NCCL_FLOAT32 = 7

    def __init__(self, form=tuple):
        self.fabric, self.local, self.form = FakeFabric(), threading.local(), form
        self.counter = iter(range(1, 10 ** 6))

    def get_unique_id(self):
        k = next(self.counter)
        uid = tuple(((k * 7 + i) % 256) - 128 for i in range(128))
        return uid if self.form is tuple else bytes(b + 128 for b in uid)

    def NcclCommunicator(self, n, uid, rank):  # noqa: N802 - CuPy's name
        assert isinstance(uid, self.form), f"this CuPy takes a {self.form.__name__} id, not {type(uid).__name__}"
        handle = FakeHandle(self.fabric, n, uid, rank)
        self.local.handles = getattr(self.local, "handles", []) + [handle]
        return handle

    def groupStart(self):  # noqa: N802
        for h in self.local.handles:
            h.grouped = []

    def groupEnd(self):  # noqa: N802
        for h in self.local.handles:
            h.flush()


class FakeStream:
    cuda_stream = 0

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


class FakeEvent:
    def record(self, stream=None):
        pass

    def query(self):
        return True


@pytest.fixture
def fake_cuda(monkeypatch):
    import contextlib
    import sys
    import types

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=lambda i: types.SimpleNamespace(use=lambda: None))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return FakeNccl()


def _on_fake_ranks(fake, axes, body, world):
    """``body(comm)`` on every rank of ``axes``, each rank a thread with its NcclCommunicator."""
    from sbpc.runtime.nccl import NcclCommunicator

    master = _store(world)
    results, errors = {}, []

    def rank_main(rank):
        try:
            comm = NcclCommunicator(Topology(axes, rank), torch.device("cpu"), store=_client(master), timeout=10,
                                    nccl=fake)
            try:
                results[rank] = body(comm)
            finally:
                comm.close()
        except Exception as err:  # noqa: BLE001
            errors.append((rank, err))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("form", [tuple, bytes], ids=["older-cupy-tuple-id", "newer-cupy-bytes-id"])
def test_nccl_communicator_collectives_on_a_dp_tp_mesh(fake_cuda, form):
    fake_cuda.form = form
    axes = (("dp", 2), ("tp", 2))

    def x_of(rank):
        return torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)

    def body(comm):
        tp, dp = comm.topology.group("tp"), comm.topology.group("dp")
        x = x_of(comm.rank)
        return {"sum": comm.all_reduce(x, tp), "max": comm.all_reduce(-x, dp, "max"),
                "gather": comm.all_gather(x, tp, 1), "scatter": comm.reduce_scatter(x, dp, 0),
                "a2a": comm.all_to_all(x, tp, 1, 0), "bf16": comm.all_reduce(x.bfloat16(), tp),
                "async": comm.start("all_gather", x, dp, dim=0).wait(), "alone": comm.all_reduce(x, (comm.rank,))}

    out = _on_fake_ranks(fake_cuda, axes, body, 4)
    topo = Topology(axes, 0)
    for r, got in out.items():
        t = Topology(axes, r)
        tp, dp = t.group("tp"), t.group("dp")
        assert torch.equal(got["sum"], sum(x_of(m) for m in tp))
        assert torch.equal(got["max"], torch.stack([-x_of(m) for m in dp]).amax(0))
        assert torch.equal(got["gather"], torch.cat([x_of(m) for m in tp], dim=1))
        assert torch.equal(got["scatter"], sum(x_of(m) for m in dp).chunk(2, dim=0)[dp.index(r)])
        assert torch.equal(got["a2a"], torch.cat([x_of(m).chunk(2, dim=1)[tp.index(r)] for m in tp], dim=0))
        assert torch.equal(got["bf16"], sum(x_of(m) for m in tp).bfloat16())
        assert torch.equal(got["async"], torch.cat([x_of(m) for m in dp], dim=0))
        assert torch.equal(got["alone"], x_of(r))
    assert topo.world_size == 4


def test_nccl_communicator_transfers_both_ways_between_stages(fake_cuda):
    axes = (("pp", 2), ("dp", 1))

    def body(comm):
        peer = 1 - comm.rank
        mine = torch.full((3, 2), float(comm.rank + 10))
        handle = comm.send(mine, peer, tag=1, what=f"activation to {peer}")
        early = comm.post_recv([3, 2], torch.float32, peer)
        got = early.wait()
        handle.wait()
        return got

    out = _on_fake_ranks(fake_cuda, axes, body, 2)
    assert torch.equal(out[0], torch.full((3, 2), 11.0)) and torch.equal(out[1], torch.full((3, 2), 10.0))


def test_nccl_communicator_refuses_a_group_it_has_not(fake_cuda):
    def body(comm):
        with pytest.raises(PlanError, match=r"all_reduce over ranks \(0, 3\): rank 0 has no NCCL communicator"):
            comm.all_reduce(torch.ones(2), (0, 3))
        with pytest.raises(PlanError, match="no NCCL communicator for rank 0 -> rank 1"):
            comm.send(torch.ones(2), 1)  # no pp axis: no transfers
        return True

    assert _on_fake_ranks(fake_cuda, (("dp", 2),), lambda c: body(c) if c.rank == 0 else True, 2) == {0: True, 1: True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_checks_one_rank_communicator_over_the_fake_nccl(fake_cuda, dtype):
    """What bench/gpu_check.py runs on NCCL at world size 1, here over the fake: every
    collective of a one-rank group is its input, and the grouped send to itself arrives."""
    from sbpc.runtime.nccl import self_communicator

    comm = self_communicator(torch.device("cpu"), nccl=fake_cuda)
    try:
        x = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(dtype)
        for got in (comm.all_reduce_async(x, (0,)).wait(), comm.all_reduce_async(x, (0,), "max").wait(),
                    comm.all_gather_async(x, (0,), 1).wait(), comm.reduce_scatter_async(x, (0,), 0).wait(),
                    comm.all_to_all_async(x, (0,), 1, 0).wait(), comm.self_transfer(x)):
            assert got.dtype == dtype and torch.equal(got, x)
    finally:
        comm.close()


def test_the_cuda_backend_trains_a_2x2_plan_over_the_fake_nccl(fake_cuda):
    """The cuda code path end to end without a GPU: CudaBackend (its kernel table, the CPU init,
    the collectives bound to it) over NcclCommunicator (fake NCCL, CPU tensors), four ranks as
    threads on mesh 2x2; the losses are the one-device plan's on the whole batch."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.runtime.backend import make_backend
    from sbpc.runtime.cuda import CudaBackend
    from sbpc.runtime.runner import BatchSource, make_runner

    one, _, _ = compile_example("mlp.py")
    mesh = compile_model(load_model("examples/mlp.py", {}), parse_mesh("2x2"), batch_size=4,
                         optimizer=OptimizerConfig()).plan
    # it communicates (collectives are issued early and waited for late: the overlap pass)
    assert any(ins.op.startswith("sbpc.all_") or ins.op == "sbpc.issue" for ins in mesh.stages[0].instructions)
    batches = [BatchSource(one.plan, 0)(i) for i in range(3)]  # made here: threads share torch's RNG
    ref = make_runner(one.plan, make_backend("cpu"), seed=0)
    want = [ref.step(b).loss for b in batches]
    axes = tuple((a.name, a.size) for a in mesh.mesh)

    def body(comm):
        runner = make_runner(mesh, CudaBackend(comm, comm.topology, device=torch.device("cpu")), seed=0)
        return [runner.step(b).loss for b in batches]

    got = _on_fake_ranks(fake_cuda, axes, body, 4)
    for rank in range(4):
        assert got[rank] == pytest.approx(want, rel=1e-6, abs=1e-7), rank
    kinds = {what for (_, _, what) in fake_cuda.fabric.calls}
    assert "allReduce" in kinds, kinds  # the gradients and the loss went through the fake NCCL


def test_pipelined_transfers_are_fifo_per_pair_and_a_plan_that_is_not_is_refused():
    """NCCL matches a pair's transfers in issue order: the compiler's interleaved schedule is
    first-in first-out per (sender, receiver); an order that receives micro-batch 1 before 0 is
    refused for cuda, naming the pair and the transfer."""
    from sbpc.compiler.driver import compile_model
    from sbpc.compiler.frontend.model_loader import load_model
    from sbpc.compiler.frontend.optim import OptimizerConfig
    from sbpc.compiler.ir.mesh import parse_mesh
    from sbpc.compiler.passes import PipelineOptions
    from sbpc.runtime.cuda import require_fifo_transfers
    from sbpc.runtime.kinds import ScheduleName
    from sbpc.runtime.pipeline import fifo_mismatch, transfer_sequences

    plan = compile_model(load_model("examples/gpt.py", {"layers": 4}), parse_mesh("1x1x2"), batch_size=4,
                         optimizer=OptimizerConfig(),
                         pipeline=PipelineOptions(ScheduleName.INTERLEAVED, virtual_stages=2, microbatches=2)).plan
    sent, received = transfer_sequences(plan)
    assert set(sent) == {(0, 1), (1, 0)} and sent == received
    assert fifo_mismatch(plan) is None
    require_fifo_transfers(plan)
    # stage 1 runs its first forward of micro-batch 1 before that of micro-batch 0
    order = [list(stage) for stage in plan.pipeline.order]
    first = [i for i, t in enumerate(order[1]) if t.phase == "fwd" and t.chunk == 1]
    i, j = first[0], first[1]
    assert (order[1][i].mb, order[1][j].mb) == (0, 1)
    order[1][i], order[1][j] = order[1][j], order[1][i]
    swapped = plan.model_copy(update={"pipeline": plan.pipeline.model_copy(update={"order": order})})
    why = fifo_mismatch(swapped)
    assert why is not None and why.startswith("stage 0 -> stage 1: transfer 0 is sent as %") and "micro-batch 0" in why
    with pytest.raises(PlanError, match="not first-in first-out, which NCCL needs: stage 0 -> stage 1"):
        require_fifo_transfers(swapped)


# --- install --------------------------------------------------------------------------------

def test_the_cuda_extra_and_a_cpu_install_without_cupy():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = meta["optional-dependencies"]["cuda"]
    assert any(r.startswith("cupy-cuda12x") for r in extra) and any(r.startswith("nvidia-nccl-cu12") for r in extra)
    assert not any("cupy" in r or "nccl" in r for r in meta["dependencies"])
    assert "torch==2.13.0" in (ROOT / "constraints-cpu.txt").read_text()


def test_importing_the_backend_needs_no_cupy(monkeypatch):
    """CuPy is imported only when more than one rank needs NCCL: a cluster node with one GPU, and
    every CPU install, load the backend without it (here an import of cupy fails)."""
    import builtins
    import importlib
    import sys

    real = builtins.__import__

    def no_cupy(name, *args, **kw):
        if name.split(".")[0] == "cupy":
            raise ImportError("No module named 'cupy' (blocked by the test)")
        return real(name, *args, **kw)

    for mod in ("sbpc.runtime.cuda", "sbpc.runtime.nccl", "sbpc.runtime.nccl_setup"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    monkeypatch.setattr(builtins, "__import__", no_cupy)
    for mod in ("sbpc.runtime.cuda", "sbpc.runtime.nccl", "sbpc.runtime.nccl_setup"):
        importlib.import_module(mod)
    from sbpc.runtime.nccl import load_nccl

    with pytest.raises(UsageError, match=r"needs CuPy's NCCL binding: .*hint: pip install -e '\.\[cuda\]'"):
        load_nccl()


# --- on a GPU (skipped without one) --------------------------------------------------------

@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_attention_matches_sdpa(dtype):
    from sbpc.runtime.cuda import attention, attention_backward

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    out, lse = attention(q.detach(), k.detach(), v.detach(), 0.0, True)
    gq, gk, gv = attention_backward(grad, q.detach(), k.detach(), v.detach(), out, lse, 0.0, True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in ((out, ref), (gq, q.grad), (gk, k.grad), (gv, v.grad)):
        assert (a.float() - b.float()).abs().max() <= tol * max(1.0, b.float().abs().max()), dtype


@pytest.mark.cuda
@needs_gpu
def test_gpu_one_device_check_passes(capsys):
    from sbpc.cli import main

    assert main(["check", "examples/gpt.py", "--backend", "cuda", "--steps", "2"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.cuda
@needs_gpu
def test_gpu_run_reports_steps(mlp_plan):
    from sbpc.runtime.cli import train
    from sbpc.runtime.plan import load_plan

    args = argparse.Namespace(plan=mlp_plan, steps=2, seed=0, backend="cuda", weights=None, save=None, threads=None,
                              timeout=60.0, trace=None)
    result = train(args, load_plan(mlp_plan), None, None)
    assert len(result["losses"]) == 2 and all(x == x for x in result["losses"])

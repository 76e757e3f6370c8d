"""The cuda backend (runtime/cuda.py, runtime/nccl.py, runtime/nccl_setup.py).

Without a GPU (CI, this machine): `--backend cuda` is refused in one line with exit 2, and the
parts that need neither CuPy nor a GPU run: the NCCL dtype table, which communicators exist and
the order every rank makes them in, the unique-id exchange over a real TCPStore,
the `[cuda]` extra (the watchdog and the communicator over a fake NCCL: tests/test_nccl.py). The tests marked ``cuda`` need a GPU and skip, with the reason, without one.
"""
from __future__ import annotations

import argparse
import threading
import time
import tomllib

import pytest
import torch

from conftest import ROOT, compile_example, sbpc, tcp_client, tcp_store
from sbpc.errors import PlanError, RuntimeFailure, UsageError
from sbpc.runtime.nccl_setup import (ID_KEY, NCCL_OPS, NCCL_TYPES, CommSpec, NcclEnum, all_gather_layout,
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

    def no_compile(args, **kw):
        raise AssertionError("compiled before refusing")

    monkeypatch.setattr(cli, "compile_from_args", no_compile)
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

    monkeypatch.setattr(cli, "compile_from_args", lambda args, **kw: pytest.fail("compiled before refusing"))
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
    picked, firsts = [], []

    class Spy:  # stands for torch.ops.aten in runtime/cuda.py, noting which attention it calls
        def __getattr__(self, name):
            real = getattr(torch.ops.aten, name)
            if "_scaled_dot_product_" not in name:
                return real
            kind = "flash" if "flash" in name else "efficient"

            def call(*a, **k):
                picked.append(kind)
                firsts.append(a[0])
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
    # a last dim of stride > 1 (which both kernels refuse) reaches them as a dense copy
    qt = torch.empty(2, 4, 16, 40, device="meta", dtype=dtype).transpose(-1, -2)
    cuda.attention(qt, k, v, 0.0, not mask, attn_mask=m)
    assert qt.stride(-1) == 40 and firsts[-1].stride(-1) == 1


@pytest.mark.parametrize("shape,dtype", [((40, 50), torch.bool), ((2, 1, 40, 50), torch.float32),
                                         ((40, 48), torch.bool), ((4, 40, 50), torch.bfloat16)])
def test_attention_bias_is_4d_aligned_and_eagers_additive_mask(shape, dtype):
    """What the memory-efficient kernel reads: a bias of the query's dtype, expanded to (batch,
    heads, queries, keys), its rows starting at multiples of 8 elements, with the mask's values
    (bool: 0 kept, -inf masked) -- what eager SDPA hands the same kernel."""
    from sbpc.runtime.cuda import BIAS_ALIGNMENT, attention_bias

    g = torch.Generator().manual_seed(0)
    q, k = torch.empty(2, 4, 40, 16, dtype=torch.bfloat16), torch.empty(2, 4, 50 if shape[-1] == 50 else 48, 16)
    mask = torch.rand(shape, generator=g) > 0.3 if dtype == torch.bool else torch.randn(shape, generator=g).to(dtype)
    bias = attention_bias(mask, q, k)
    assert bias.shape == (2, 4, 40, k.shape[2]) and bias.dtype == q.dtype and bias.stride(-1) == 1
    assert all(st % BIAS_ALIGNMENT == 0 for st in bias.stride()[:-1]), bias.stride()
    want = torch.zeros(shape, dtype=q.dtype).masked_fill(~mask, float("-inf")) if dtype == torch.bool else mask.to(q.dtype)
    assert torch.equal(bias, want.expand(bias.shape))
    assert attention_bias(None, q, k) is None


def test_check_puts_a_fused_adamws_step_count_where_torch_optim_does():
    """`sbpc check` loads the plan's state into eager's optimizer: a fused AdamW's step count
    must be on the parameter's device (its CUDA kernel reads it there; a CPU one is refused, or
    read through a host pointer), a plain AdamW's on the CPU, as torch.optim makes them."""
    import types

    from sbpc.compiler.tools.check import step_device

    w = torch.nn.Parameter(torch.ones(3))
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 1))
    assert step_device(torch.optim.AdamW([w], fused=True), on_gpu) == torch.device("cuda", 1)
    assert step_device(torch.optim.AdamW([w], capturable=True), on_gpu) == torch.device("cuda", 1)
    assert step_device(torch.optim.AdamW([w], foreach=False), on_gpu) == torch.device("cpu")
    for fused in (True, False):  # torch.optim's own choice, on this machine's device
        opt = torch.optim.AdamW([w], fused=fused, foreach=False)
        w.grad = torch.ones(3)
        opt.step()
        assert opt.state[w]["step"].device == step_device(opt, w) and opt.state[w]["step"].dtype == torch.float32


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
        got = lay.finish(flat.reshape(lay.out_shape))
        assert torch.equal(got, torch.cat(xs, dim=dim)) and got.is_contiguous()  # strides as gloo's cat gives


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_reduce_scatter_layout_gives_this_members_chunk_of_the_sum(dim):
    n = 2
    xs = _members(n, (4, 6, 2), seed=1)
    lays = [reduce_scatter_layout(x, n, dim) for x in xs]
    total = sum(lay.src.reshape(-1) for lay in lays)  # ncclReduceScatter: block i of the sum to rank i
    count = total.numel() // n
    for i, lay in enumerate(lays):
        got = lay.finish(total[i * count:(i + 1) * count].reshape(lay.out_shape))
        assert torch.equal(got, sum(xs).chunk(n, dim=dim)[i]) and got.is_contiguous()


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


def test_unique_id_exchange_over_a_tcpstore():
    """Three ranks (threads, each with its own store client) exchange the ids of every
    communicator they belong to, in ``mine`` order; every member gets its leader's id."""
    master = tcp_store(4)
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
            store = tcp_client(master)
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
    master = tcp_store(2)
    spec = CommSpec((0, 1), "dp")
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"NCCL setup of mesh axis dp \(ranks \(0, 1\)\) failed on rank 1: "
                                             r"no unique id from rank 0 within 0.3s \(it hung or died\)") as info:
        exchange_unique_id(tcp_client(master), spec, 1, lambda: pytest.fail("only the leader makes the id"),
                           timeout=0.3, poll=0.02)
    assert time.monotonic() - start < 5
    assert info.value.peer == 0 and info.value.secondary and info.value.timed_out


def test_unique_id_wait_names_a_failed_leader():
    master = tcp_store(2)
    master.set("sbpc/failed/0", "ModelError: bad model file")
    with pytest.raises(RuntimeFailure, match="failed on rank 1: rank 0 failed: ModelError: bad model file"):
        exchange_unique_id(tcp_client(master), CommSpec((0, 1), "tp"), 1, tuple, timeout=10, poll=0.02)


# --- install --------------------------------------------------------------------------------

def test_the_cuda_extra_and_a_cpu_install_without_cupy():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = meta["optional-dependencies"]["cuda"]
    assert any(r.startswith("cupy-cuda12x") for r in extra)
    # NCCL comes with torch's CUDA wheel: nvidia-nccl-cu12 and -cu13 write the same libnccl.so.2
    assert not any(r.startswith("nvidia-nccl") for r in extra)
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

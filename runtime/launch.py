"""Spawn local ranks, run a function on each, and never hang silently.

``launch(world_size, "module:function", payload, timeout=...)`` starts ``world_size`` fresh
Python processes (``subprocess``; each imports torch once, about as fast as torch.multiprocessing's
spawn and without pickling through a pipe). The parent hosts the rendezvous TCPStore, so a
dying rank 0 never takes the store with it. Each child joins the gloo group
(``runtime.dist.init_process_group``), calls ``function(payload)`` and hands back its return
value (pickled, through a file in a private temporary directory).

The parent watches the children. When one fails (an exception, ``os._exit``, a signal), the
others get ``grace`` seconds to end on their own (a peer's broken collective ends them
quickly), then are terminated and killed, and ``launch`` raises an error naming the rank that
failed first:

- an ``SbpcError`` raised by a rank comes back as the same class with the same message, hint
  and location, prefixed ``rank N:``;
- any other exception as ``RuntimeFailure("rank N failed: Type: first line")`` (traceback in
  ``detail``, shown with --debug);
- a rank that died without a word as ``rank N exited with code C`` / ``was killed by SIGKILL``;
- a rank that hangs makes its peers' collectives time out after ``timeout`` seconds; those
  ranks fail, the hung one is still running, and the error names it: ``rank N hung``.

``launch(..., ranks="threads")`` runs the ranks as threads of this process instead
(``runtime/thread_launch.py``, ``runtime/threads.py``): same target, results and errors, no
interpreter per rank.
"""
from __future__ import annotations

import collections
import importlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Literal

from sbpc import errors as _errors
from sbpc.errors import RuntimeFailure, SbpcError, UsageError
from sbpc.runtime.files import atomic_path

_BOOT = "from sbpc.runtime.launch import worker_main; worker_main()"


def resolve_target(target: str) -> Callable[[Any], Any]:
    module, _, name = target.partition(":")
    if not module or not name:
        raise RuntimeFailure(f"launch target {target!r} is not 'module:function'")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def default_threads(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


RankMode = Literal["processes", "threads"]
RANK_MODES: tuple[RankMode, ...] = ("processes", "threads")


def launch(world_size: int, target: str, payload: dict, *, timeout: float, grace: float = 3.0,
           on_output: Callable[[int, str], None] | None = None, echo_stderr: bool = False,
           threads: int | None = None, ranks: RankMode = "processes") -> list[Any]:
    """Run ``target(payload)`` on ``world_size`` local ranks joined over gloo; return each
    rank's return value, in rank order. ``timeout`` bounds the rendezvous and every
    collective. ``on_output(rank, line)`` receives the ranks' stdout lines as they come
    (default: rank 0's to stdout, the others' prefixed ``[rank N]``); stderr is kept for error
    reports (and echoed to stderr with ``echo_stderr``). ``ranks="threads"`` runs the ranks as
    threads of this process instead (``runtime.thread_launch.launch_threads``, same contract)."""
    import torch.distributed as dist

    if ranks not in RANK_MODES:
        raise UsageError(f"ranks {ranks!r} is not one of {', '.join(RANK_MODES)}",
                         hint="processes: one gloo process per rank; threads: every rank in this process")
    if ranks == "threads":
        from sbpc.runtime.thread_launch import launch_threads

        return launch_threads(world_size, target, payload, timeout=timeout, grace=grace, on_output=on_output,
                              threads=threads)
    if world_size < 1:
        raise RuntimeFailure(f"cannot launch {world_size} ranks")
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    threads = threads or default_threads(world_size)
    out = on_output or _print_output
    with tempfile.TemporaryDirectory(prefix="sbpc-launch-") as tmp:
        spec = os.path.join(tmp, "spec.pkl")
        with open(spec, "wb") as f:
            pickle.dump({"target": target, "payload": payload, "timeout": timeout, "sys_path": list(sys.path)}, f)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world_size),
               "SBPC_STORE": "client", "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        ranks = [_Rank(r, spec, {**env, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world_size)},
                       out, echo_stderr) for r in range(world_size)]
        try:
            hung = _watch(ranks, grace, tmp)
        finally:
            _stop(ranks)
        failure = _failure(ranks, tmp, hung, timeout)
        if failure is not None:
            raise failure
        return [_load(os.path.join(tmp, f"rank{r.rank}.out")) for r in ranks]


class _Rank:
    def __init__(self, rank: int, spec: str, env: dict, out: Callable[[int, str], None], echo: bool):
        self.rank, self.exit_time = rank, None
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, spec, str(rank)], env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
        self.stderr: collections.deque[str] = collections.deque(maxlen=50)
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, lambda line: out(rank, line)), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self._err_line(echo)), daemon=True)]
        for t in self.readers:
            t.start()

    def _err_line(self, echo: bool):
        def take(line: str) -> None:
            self.stderr.append(line)
            if echo:
                sys.stderr.write(f"[rank {self.rank}] {line}")
        return take

    @staticmethod
    def _read(stream, sink) -> None:
        try:
            for line in stream:
                sink(line)
        except (ValueError, OSError):
            pass

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.exit_time is None:
            self.exit_time = time.monotonic()
        return code


def _print_output(rank: int, line: str) -> None:
    sys.stdout.write(line if rank == 0 else f"[rank {rank}] {line}")
    sys.stdout.flush()


def _watch(ranks: list[_Rank], grace: float, tmp: str) -> list[int]:
    """Wait until every rank ends, or until ``grace`` seconds after the first failure (half a
    second when that failure is a collective timeout: its peers had ``timeout`` already);
    return the ranks still running then."""
    first_failure = None
    while True:
        codes = [r.poll() for r in ranks]
        if all(c is not None for c in codes):
            return []
        failed = [r for r, c in zip(ranks, codes) if c not in (None, 0)]
        if first_failure is None and failed:
            first_failure = time.monotonic()
            path = os.path.join(tmp, f"rank{failed[0].rank}.err")
            if os.path.exists(path) and _load(path).get("timed_out"):
                grace = min(grace, 0.5)
        if first_failure is not None and time.monotonic() - first_failure > grace:
            return [r.rank for r, c in zip(ranks, codes) if c is None]
        time.sleep(0.02)


def _stop(ranks: list[_Rank]) -> None:
    """Terminate what still runs, kill it a second later, and drain the output readers."""
    alive = [r for r in ranks if r.proc.poll() is None]
    for r in alive:
        r.proc.terminate()
    deadline = time.monotonic() + 1.0
    for r in alive:
        try:
            r.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
    for r in ranks:
        for t in r.readers:
            t.join(2.0)


def _load(path: str):
    with open(path, "rb") as f:
        return pickle.load(f)


def _failure(ranks: list[_Rank], tmp: str, hung: list[int], timeout: float) -> Exception | None:
    if not hung and all(r.proc.returncode == 0 for r in ranks):
        return None
    records = {}
    for r in ranks:
        path = os.path.join(tmp, f"rank{r.rank}.err")
        if os.path.exists(path):
            records[r.rank] = _load(path)
    died = [r.rank for r in ranks if r.rank not in hung and r.rank not in records and r.proc.returncode not in (0, None)]
    return pick_failure(records, hung, timeout, died=_died(ranks[min(died, key=lambda k: (ranks[k].exit_time or 0.0, k))])
                        if died else None) or RuntimeFailure("a rank failed without a trace")


def _died(r: _Rank) -> RuntimeFailure:
    code = r.proc.returncode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    last = next((line.strip() for line in reversed(r.stderr) if line.strip()), "")
    err = RuntimeFailure(f"rank {r.rank} {how} without reporting an error" + (f": {last}" if last else ""),
                         hint="the other ranks were stopped; a signal often means the rank ran out of memory",
                         detail="".join(r.stderr) or None)
    err.rank = r.rank
    return err


def pick_failure(records: dict[int, dict], hung: list[int], timeout: float,
                 died: Exception | None = None) -> Exception | None:
    """The error of a failed launch from the ranks' ``error_record``s (shared by processes and
    rank threads): a rank's own error before peers' broken collectives, the earliest first
    and, when several ranks raised the same message, the lowest rank; then ``died`` (a rank
    that ended without a record); then a hung rank, named by the peer that waited for it."""
    order = lambda rank: (records[rank]["time"], rank)  # noqa: E731
    primary = [r for r in records if not records[r]["secondary"]]
    if primary:
        first = records[min(primary, key=order)]
        same = [r for r in primary if records[r]["message"] == first["message"]]  # all ranks hit the same error
        return _from_record(records[min(same)])
    if died is not None:
        return died
    if hung:
        waiting = sorted(records)
        named = [records[r]["peer"] for r in sorted(waiting, key=order) if records[r].get("peer") in hung]
        culprit = named[0] if named else hung[0]  # the peer a timed-out rank waited for, when it knows
        why = f" ({records[min(waiting, key=order)]['message']})" if waiting else ""
        err = RuntimeFailure(f"rank {culprit} hung: rank{'s' if len(waiting) != 1 else ''} "
                             f"{', '.join(map(str, waiting)) or '?'} gave up waiting for it after {timeout:g}s{why}",
                             hint="raise --timeout if the rank is only slow; --debug shows each rank's stderr")
        err.rank = culprit
        return err
    return _from_record(records[min(records, key=order)]) if records else None


def _from_record(rec: dict) -> Exception:
    cls = getattr(_errors, rec["type"], None) if rec["sbpc"] else None
    if isinstance(cls, type) and issubclass(cls, SbpcError):
        err = cls(f"rank {rec['rank']}: {rec['message']}", hint=rec["hint"], location=rec["location"], detail=rec["detail"])
    else:
        err = RuntimeFailure(f"rank {rec['rank']} failed: {rec['type']}: {rec['message']}",
                             hint="rerun with --debug for the rank's traceback", detail=rec["detail"])
    err.rank = rec["rank"]
    return err


def error_record(rank: int, err: BaseException) -> dict:
    sbpc = isinstance(err, SbpcError)
    text = str(err).strip()
    return {
        "rank": rank, "type": type(err).__name__, "sbpc": sbpc, "time": time.monotonic(),
        "secondary": bool(getattr(err, "secondary", False)),
        "timed_out": bool(getattr(err, "timed_out", False)), "peer": getattr(err, "peer", None),
        "message": err.message if sbpc else (text.splitlines()[0] if text else type(err).__name__),
        "hint": getattr(err, "hint", None) if sbpc else None,
        "location": getattr(err, "location", None) if sbpc else None,
        "detail": "".join(traceback.format_exception(err)) + (f"\n{err.detail}" if sbpc and err.detail else ""),
    }


def _dump(obj, path: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        pickle.dump(obj, f)


def worker_main() -> None:
    """Entry of a spawned rank: ``python -c ... spec.pkl RANK``."""
    spec_path, rank = sys.argv[1], int(sys.argv[2])
    tmp = os.path.dirname(spec_path)
    code = 0
    try:
        with open(spec_path, "rb") as f:
            spec = pickle.load(f)
        sys.path[:0] = [p for p in spec["sys_path"] if p not in sys.path]
        import torch

        from sbpc.runtime import dist as sdist

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        fn = resolve_target(spec["target"])
        sdist.init_process_group(spec["timeout"])
        result = fn(spec["payload"])
        _dump(result, os.path.join(tmp, f"rank{rank}.out"))
        sdist.shutdown()
    except BaseException as err:  # noqa: BLE001 - every failure is reported to the parent
        if isinstance(err, SystemExit) and err.code in (0, None):
            _dump(None, os.path.join(tmp, f"rank{rank}.out"))
        else:
            code = 2 if isinstance(err, SbpcError) else 1
            try:
                _dump(error_record(rank, err), os.path.join(tmp, f"rank{rank}.err"))
            finally:
                from sbpc.runtime import dist as sdist

                sdist.report_failure(rank, err)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: gloo's destructors may wait on dead peers

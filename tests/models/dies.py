"""examples/mlp.py, whose ``example_batch`` ends its process at once (``os._exit``: no cleanup, no
message, as a killed rank dies) on the call that ``$SBPC_TEST_DIE`` names as ``RANK:CALL``
(counting from 1). ``example_batch`` runs once per training step, so this kills rank RANK in
step CALL - 1. For the kill-and-resume test (tests/test_checkpoint.py)."""
import importlib.util
import os
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_sbpc_mlp", Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
_mlp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mlp)
build_model = _mlp.build_model
_calls = 0


def example_batch(batch_size, **kw):
    global _calls
    _calls += 1
    rank, _, call = os.environ.get("SBPC_TEST_DIE", "").partition(":")
    if rank and os.environ.get("RANK") == rank and _calls == int(call):
        os._exit(9)
    return _mlp.example_batch(batch_size, **kw)

"""Error behaviour beyond the bad-input corpus (tests/test_bad_input.py): --debug, the flag that
turns an error into a warning, and atomic writes."""
import os

import pytest

from conftest import sbpc


def test_debug_shows_the_traceback():
    proc = sbpc("compile", "tests/models/no_build.py", "--debug")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "has no function build_model()" in proc.stderr


def test_allow_replicated_accepts_an_axis_that_splits_nothing(tmp_path):
    proc = sbpc("compile", "tests/models/four_heads.py", "--mesh", "1x3", "--allow-replicated",
                "-o", str(tmp_path / "p.json"))
    assert proc.returncode == 0, proc.stderr
    from sbpc.runtime.plan import load_plan

    plan = load_plan(str(tmp_path / "p.json"))
    assert plan.world_size == 3 and "splits no tensor" not in proc.stderr


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path):
    from sbpc.errors import OutputError
    from sbpc.runtime.files import atomic_path

    target = tmp_path / "plan.json"
    target.write_text("old")
    with pytest.raises(OutputError, match=r"cannot write '.*plan\.json': No space left on device"):
        with atomic_path(str(target)) as tmp:
            with open(tmp, "w") as f:
                f.write("half")
            raise OSError(28, "No space left on device")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["plan.json"]

"""The README's command examples run as written (the 1T compile is covered by test_capture)."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    cmds = []
    for block in blocks[1:]:  # the first block is `make demo` / `make test`
        for line in block.splitlines():
            line = line.split("#", 1)[0].split("|", 1)[0].strip()
            if line.startswith(".venv/bin/sbpc") and "preset=1t" not in line:
                cmds.append(line)
    return cmds


def test_readme_opens_with_the_two_make_commands():
    first = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert [line.split("#")[0].strip() for line in first.strip().splitlines()] == ["make demo", "make test"]


def test_readme_commands_run(tmp_path):
    cmds = readme_commands()
    assert len(cmds) >= 8
    for d in ("examples", "tests"):
        (tmp_path / d).symlink_to(ROOT / d)
    exe = str(Path(sys.executable).parent / "sbpc")
    for cmd in cmds:
        argv = [exe, *shlex.split(cmd)[1:]]
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": ""})
        assert proc.returncode == 0, f"{cmd}\n{proc.stderr}"

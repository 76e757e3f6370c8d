"""The bad-input corpus's vocabulary (tests/test_bad_input.py): a ``Case`` row, and the setups
that write the files a case needs into its directory first -- models, configs, compiled and
then edited plans, checkpoints with a flipped byte -- plus the command lines rows share."""
from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

@dataclass(frozen=True)
class Case:
    name: str
    argv: list[str]
    culprit: str | tuple[str, ...]
    setup: Callable[[Path], None] | None = None
    env: dict[str, str] = field(default_factory=dict)

    def culprits(self) -> tuple[str, ...]:
        return (self.culprit,) if isinstance(self.culprit, str) else self.culprit


def write(name: str, text: str) -> Callable[[Path], None]:
    """A setup that writes ``text`` (dedented) to ``{tmp}/name``."""
    return lambda tmp: (tmp / name).write_text(textwrap.dedent(text).lstrip("\n"))


_plans: dict[str, str] = {}


def compiled(edit: Callable[[str], str] | None = None, *flags: str) -> Callable[[Path], None]:
    """A setup that writes ``{tmp}/plan.json``: examples/mlp.py compiled (for mesh 1, or with
    the compile ``flags``) once per session, passed through ``edit`` (text -> text) when given."""
    def setup(tmp: Path) -> None:
        key = " ".join(flags)
        if key not in _plans:
            from sbpc.cli import main

            out = tmp / "_compiled.json"
            assert main(["compile", "examples/mlp.py", *flags, "-o", str(out)]) == 0
            _plans[key] = out.read_text()
            out.unlink()
        (tmp / "plan.json").write_text(edit(_plans[key]) if edit else _plans[key])
    return setup


def compiled_lm(then: Callable[[Path], None] | None = None) -> Callable[[Path], None]:
    """A setup that writes ``{tmp}/plan.json``: tests/models/tiny_lm.py (token ids, vocabulary
    256, seq 8) compiled for mesh 1 once per session, then runs ``then`` (the data file)."""
    def setup(tmp: Path) -> None:
        if "lm" not in _plans:
            from sbpc.cli import main

            out = tmp / "_compiled.json"
            assert main(["compile", "tests/models/tiny_lm.py", "-o", str(out)]) == 0
            _plans["lm"] = out.read_text()
            out.unlink()
        (tmp / "plan.json").write_text(_plans["lm"])
        if then is not None:
            then(tmp)
    return setup


def chain(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda tmp: [s(tmp) for s in setups] and None


def edit_json(change: Callable[[dict], None]) -> Callable[[str], str]:
    def edit(text: str) -> str:
        raw = json.loads(text)
        change(raw)
        return json.dumps(raw)
    return edit


def set_at(path: str, value) -> Callable[[dict], None]:
    def change(raw: dict) -> None:
        *parents, last = path.split(".")
        node = raw
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[int(last) if isinstance(node, list) else last] = value
    return change


EDITED = "was changed after sbpc wrote it: its content does not match its digest"
DP4 = ("--mesh", "4x1")  # a 4-rank plan, for sbpc launch
def recompiled_model(tmp: Path) -> None:
    """examples/mlp.py copied to {tmp}/model.py and compiled there, then its example_batch cut to
    one tensor, as when a model file changes after the compile."""
    from sbpc.cli import main

    text = Path("examples/mlp.py").read_text()
    (tmp / "model.py").write_text(text)
    assert main(["compile", str(tmp / "model.py"), "-o", str(tmp / "plan.json")]) == 0
    (tmp / "model.py").write_text(text.replace("return torch.randn(batch_size, dim_in), torch.randn(batch_size, dim_out)",
                                               "return (torch.randn(batch_size, dim_in),)"))


MLP = ["compile", "examples/mlp.py", "-o", "{tmp}/plan.json"]
GPT_TP = ["compile", "examples/gpt.py", "--config", "examples/gpt.megatron.toml", "--set", "layers=1", "-o", "{tmp}/p.json"]


def config(text: str, model: str = "examples/mlp.py", mesh: str = "1x2") -> tuple[list[str], Callable[[Path], None]]:
    """argv and setup of a compile with the parallel config ``text``."""
    return (["compile", model, "--mesh", mesh, "--config", "{tmp}/parallel.toml", "-o", "{tmp}/p.json"],
            write("parallel.toml", text))


def config_case(name: str, text: str, culprit, **kw) -> Case:
    argv, setup = config(text, **kw)
    return Case(name, argv, culprit, setup)


_checkpoint: dict[str, bytes] = {}


def checkpointed(edit: Callable[[Path], None] | None = None, *sets: str) -> Callable[[Path], None]:
    """A setup that writes ``{tmp}/c``, the checkpoint of one step of examples/mlp.py on mesh 1
    (made once per session), with ``edit`` applied to its ``step_00000001`` directory, and
    ``{tmp}/plan.json`` (mlp with ``sets``) to resume it into."""
    def setup(tmp: Path) -> None:
        import contextlib
        import io
        import shutil

        from sbpc.cli import main

        if not _checkpoint:
            compiled()(tmp)
            with contextlib.redirect_stdout(io.StringIO()):
                assert main(["run", str(tmp / "plan.json"), "--steps", "1", "--save", str(tmp / "c")]) == 0
            _checkpoint.update({str(f.relative_to(tmp / "c")): f.read_bytes() for f in (tmp / "c").rglob("*")
                                if f.is_file()})
            shutil.rmtree(tmp / "c")
        for name, data in _checkpoint.items():
            (tmp / "c" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / "c" / name).write_bytes(data)
        compiled(None, *sets)(tmp)
        if edit:
            edit(tmp / "c" / "step_00000001")
    return setup


def index_edit(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        raw = json.loads((d / "index.json").read_text())
        change(raw)
        (d / "index.json").write_text(json.dumps(raw))
    return edit


def shard_edit(change: Callable[[bytearray], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        f = d / "rank00000.safetensors"
        data = bytearray(f.read_bytes())
        change(data)
        f.write_bytes(bytes(data))
    return edit


def flip_in(key: str) -> Callable[[bytearray], None]:
    """Flip a byte in the middle of tensor ``key``'s data (safetensors: an 8-byte header
    length, the JSON header, then the data)."""
    def change(data: bytearray) -> None:
        n = int.from_bytes(data[:8], "little")
        start, end = json.loads(bytes(data[8:8 + n]))[key]["data_offsets"]
        data[8 + n + (start + end) // 2] ^= 0xFF
    return change


def truncate(data: bytearray) -> None:
    del data[100:]


def garble_header(data: bytearray) -> None:
    data[8:24] = b"\xff" * 16


RESUME = ["run", "{tmp}/plan.json", "--steps", "2", "--resume", "{tmp}/c"]

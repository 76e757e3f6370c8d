"""Parallel hints: the config format, in-code sbpc.shard, and their errors."""
from __future__ import annotations

import re

import pytest

from sbpc.compiler.frontend.hints import glob_match, load_config
from sbpc.errors import UsageError
from sbpc.runtime.sbp import Split


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "parallel.toml"
    path.write_text(text)
    return str(path)


def test_config_parses_params_and_modules(tmp_path):
    cfg = load_config(_config(tmp_path, '[params]\n"h.*.w" = { tp = "S(0:3)" }\n[modules]\n"h.*" = { tp = "S(1)" }\n'))
    hints = cfg.param_hints(["h.0.w", "h.1.w", "h.0.b"])
    assert set(hints) == {"h.0.w", "h.1.w"} and hints["h.0.w"].as_dict() == {"tp": Split(0, 3)}
    assert hints["h.0.w"].source.endswith("parallel.toml:2")
    assert cfg.module_hint("h.3").as_dict() == {"tp": Split(1)} and cfg.module_hint("h.3.attn") is None


def test_globs_match_one_path_component_per_star():
    assert glob_match("h.0", "h.*") and not glob_match("h.0.attn", "h.*")
    assert glob_match("model.h.0.attn.c_proj.weight", "**.c_proj.weight")


def test_glob_that_matches_nothing(tmp_path):
    cfg = load_config(_config(tmp_path, '[params]\n"h.*.attn.qkv.weight" = { tp = "S(0)" }\n'))
    with pytest.raises(UsageError, match=r"parameter glob 'h\.\*\.attn\.qkv\.weight' matches no parameter.*"
                                         r"parallel\.toml:2.*hint: parameters are named by module path, e\.g\. h\.0"):
        cfg.param_hints(["h.0.attn.c_attn.weight", "wte.weight"])


@pytest.mark.parametrize("text,pattern", [
    ('[params]\n"w" = { tp = "S(x)" }\n', r"bad SBP 'S\(x\)'.*parallel\.toml:2.*hint: write S\(dim\)"),
    ('[params]\n"w" = { xp = "S(0)" }\n', r"unknown mesh axis 'xp' in a hint.*parallel\.toml:2.*hint: SBP axes are dp, cp, tp"),
    ('[params]\n"w" = { pp = "S(0)" }\n', r"unknown mesh axis 'pp'.*pp is placement"),
    ('[params]\n"w" = "S(0)"\n', r"\[params\] 'w' must map axes to SBP"),
    ('[parms]\n', r"unknown table \[parms\]"),
    ('[params\n', r"is not valid TOML"),
])
def test_config_errors(tmp_path, text, pattern):
    with pytest.raises(UsageError) as err:
        load_config(_config(tmp_path, text))
    assert re.search(pattern, str(err.value)), str(err.value)


def test_missing_config_file():
    with pytest.raises(UsageError, match=r"parallel config 'nope\.toml' does not exist"):
        load_config("nope.toml")

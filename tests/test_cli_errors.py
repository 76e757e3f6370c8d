"""Bad input ends in one line naming the culprit and a hint, exit code 2, no traceback."""
import json
import os
import re

import pytest

from conftest import sbpc


def assert_one_line_error(proc, pattern: str):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert "hint:" in lines[0]


def test_missing_model_file():
    assert_one_line_error(sbpc("compile", "nope/missing.py"), r"model file 'nope/missing\.py' does not exist")


def test_model_without_build_model():
    assert_one_line_error(sbpc("compile", "tests/models/no_build.py"), r"has no function build_model\(\)")


def test_forward_not_returning_a_scalar():
    proc = sbpc("compile", "tests/models/not_scalar.py")
    assert_one_line_error(proc, r"forward\(\) must return the scalar loss, but returned a tensor of shape \[4, 2\]"
                                r" \(at tests/models/not_scalar\.py:9\)")


def test_data_dependent_control_flow_names_the_line():
    proc = sbpc("compile", "tests/models/data_dependent.py")
    assert_one_line_error(proc, r"cannot trace forward\(\): data-dependent control flow "
                                r"\(at tests/models/data_dependent\.py:11\)")


def test_in_place_buffer_update_is_refused():
    proc = sbpc("compile", "tests/models/inplace_buffer.py")
    assert_one_line_error(proc, r"forward\(\) updates buffer 'bn\.num_batches_tracked' in place \(aten\.add_\.Tensor\) "
                                r"\(at bn @ tests/models/inplace_buffer\.py:13\)")


@pytest.mark.parametrize("bad", ["layers", "=4", "9x=1"])
def test_bad_set_syntax(bad):
    assert_one_line_error(sbpc("compile", "examples/mlp.py", "--set", bad), r"bad --set")


def test_set_key_the_model_does_not_take():
    proc = sbpc("compile", "examples/mlp.py", "--set", "depth=3")
    assert_one_line_error(proc, r"build_model\(\) in examples/mlp\.py does not accept these --set values")


def test_set_value_the_model_rejects():
    proc = sbpc("compile", "examples/gpt.py", "--set", "preset=huge")
    assert_one_line_error(proc, r"rejected the --set values: unknown preset 'huge'.*\(at examples/gpt\.py:\d+\)")


@pytest.mark.parametrize("mesh,pattern", [("2x0", r"bad mesh size '0'"), ("dp=2,foo=2", r"unknown mesh axis 'foo'"),
                                          ("1x1x1x1", r"has 4 axes"), ("dp=1,dp=1", r"names an axis twice")])
def test_bad_mesh(mesh, pattern):
    assert_one_line_error(sbpc("compile", "examples/mlp.py", "--mesh", mesh), pattern)


def test_sbp_that_does_not_divide_a_shape(tmp_path):
    proc = sbpc("compile", "examples/gpt.py", "--mesh", "1x2", "--config", "examples/gpt.megatron.toml",
                "--set", "vocab=255", "-o", str(tmp_path / "p.json"))
    assert_one_line_error(proc, r"SBP tp=S\(0\) of param 'wte\.weight' does not divide its shape \[255, 64\] "
                                r"over tp=2 \(at examples/gpt\.megatron\.toml:\d+\); hint: pick a split dim")


def test_batch_that_does_not_divide_over_dp(tmp_path):
    proc = sbpc("compile", "examples/mlp.py", "--mesh", "4x1", "--batch-size", "6", "-o", str(tmp_path / "p.json"))
    assert_one_line_error(proc, r"batch\.0 has shape \[6, .*\]: its batch dim does not divide over dp=4; "
                                r"hint: use a --batch-size that is a multiple of 4")


def test_corrupt_plan_json(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text('{"schema_version": 2, "stages": [')
    assert_one_line_error(sbpc("run", str(plan)), r"is not valid JSON.*\(at .*plan\.json:1:\d+\)")


def test_wrong_schema_version(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema_version": 99}))
    assert_one_line_error(sbpc("inspect", str(plan)), r"schema_version 99, this sbpc reads version 2")


def test_malformed_plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema_version": 2, "stages": 3}))
    assert_one_line_error(sbpc("run", str(plan)), r"is malformed at")


def test_missing_plan_file():
    assert_one_line_error(sbpc("run", "does/not/exist.json"), r"plan file 'does/not/exist\.json' does not exist")


def test_debug_shows_the_traceback():
    proc = sbpc("compile", "tests/models/no_build.py", "--debug")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "has no function build_model()" in proc.stderr


def test_converting_a_built_module_explains_the_fake_tensor_limit():
    proc = sbpc("compile", "tests/models/to_dtype.py")
    assert_one_line_error(proc, r"build_model\(\) failed: .*Couldn't swap Linear\.weight \(at tests/models/to_dtype\.py:9\).*"
                                r"create the parameters in their dtype instead")


@pytest.mark.parametrize("argv,pattern", [
    (["compile", "examples/mlp.py", "--batch-size", "x"], r"sbpc compile: error: argument --batch-size: invalid int value: 'x'"),
    (["compile", "examples/mlp.py", "--frob"], r"unrecognized arguments: --frob"),
    ([], r"the following arguments are required: command"),
])
def test_usage_errors_are_one_line_too(argv, pattern):
    assert_one_line_error(sbpc(*argv), pattern)


def test_axis_that_can_split_nothing_lists_the_valid_sizes(tmp_path):
    proc = sbpc("compile", "tests/models/four_heads.py", "--mesh", "1x3", "-o", str(tmp_path / "p.json"))
    assert_one_line_error(proc, r"tp=3 splits no tensor of the model: no forward op of it can split its tensors over 3 "
                                r"devices; valid tp: 1, 2, 4, 8, 16, 32, 64; hint: use one of those sizes, or pass "
                                r"--allow-replicated")
    assert not (tmp_path / "p.json").exists()


def test_allow_replicated_accepts_an_axis_that_splits_nothing(tmp_path):
    proc = sbpc("compile", "tests/models/four_heads.py", "--mesh", "1x3", "--allow-replicated",
                "-o", str(tmp_path / "p.json"))
    assert proc.returncode == 0, proc.stderr
    from sbpc.runtime.plan import load_plan

    plan = load_plan(str(tmp_path / "p.json"))
    assert plan.world_size == 3 and "splits no tensor" not in proc.stderr


def test_pp_above_the_layer_units_names_the_maximum(tmp_path):
    proc = sbpc("compile", "examples/mlp.py", "--mesh", "1x1x8", "-o", str(tmp_path / "p.json"))
    assert_one_line_error(proc, r"pp=8 needs a layer unit per pipeline stage, but the model has only 6 to cut between "
                                r"\(layers\.0, \(root\), layers\.1, .*\); the maximum pp is 6; hint: pipeline stages are "
                                r"cut between layers")


@pytest.mark.parametrize("flag,path,pattern", [
    ("-o", "/nonexistent/dir/plan.json", r"cannot write the plan \(--output\) to '/nonexistent/dir/plan\.json': "
                                         r"directory '/nonexistent/dir' does not exist; hint: create the directory"),
    ("-o", "{tmp}", r"cannot write the plan \(--output\) to '.*': it is a directory; hint: pass a file path inside it"),
    ("--trace", "/nonexistent/sim.json", r"cannot write the simulated trace \(--trace\) to '/nonexistent/sim\.json'"),
    ("--dump-dir", "{tmp}/file", r"cannot write the IR dumps \(--dump-dir\) into '.*/file': it is a file, not a directory"),
])
def test_output_path_that_cannot_be_written_fails_before_compiling(tmp_path, flag, path, pattern):
    (tmp_path / "file").write_text("")
    args = [flag, path.format(tmp=tmp_path)] + ([] if flag == "-o" else ["-o", str(tmp_path / "p.json")])
    assert_one_line_error(sbpc("compile", "examples/mlp.py", *args), pattern)
    assert not (tmp_path / "p.json").exists()


def test_output_without_permission_is_exit_2_and_leaves_nothing():
    # /sys refuses new files even to root (a read-only directory would not stop root)
    proc = sbpc("compile", "examples/mlp.py", "-o", "/sys/sbpc-plan.json")
    assert_one_line_error(proc, r"cannot write (the plan \(--output\) to )?'/sys/sbpc-plan\.json': [Pp]ermission denied")
    assert not [p for p in os.listdir("/sys") if p.startswith("sbpc-plan")]


@pytest.mark.parametrize("flag", ["--save", "--trace"])
def test_run_output_paths_are_checked_first(tmp_path, flag):
    proc = sbpc("run", str(tmp_path / "missing.json"), flag, "/nonexistent/out.pt")
    assert_one_line_error(proc, rf"cannot write the (weights|trace) \({flag}\) to '/nonexistent/out\.pt'")


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

"""The memory options a user gives (flags or the config's [memory] table): parsed and
validated in one place, bad values refused with one line."""
import pytest

from sbpc.compiler.frontend.hints import load_config
from sbpc.compiler.memory_options import MemoryOptions, memory_options, parse_bytes
from sbpc.errors import UsageError
from sbpc.runtime.kinds import Precision, Recompute


def test_memory_sizes_parse_in_decimal_and_binary_units():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("1.5 mb") == 1_500_000
    assert parse_bytes("4096") == 4096
    for bad in ("80 gigs", "-1GB", "0", ""):
        with pytest.raises(UsageError, match="is not a memory size"):
            parse_bytes(bad)


def test_options_validate_and_default():
    assert memory_options() == MemoryOptions()
    o = memory_options(zero=2, recompute="selective", precision="bf16", device_memory="80GB")
    assert (o.zero, o.recompute, o.precision, o.device_memory) == (2, Recompute.SELECTIVE, Precision.BF16, 80 * 10**9)
    with pytest.raises(UsageError, match="zero stage 4 is not one of"):
        memory_options(zero=4)
    with pytest.raises(UsageError, match="zero stage True"):
        memory_options(zero=True)
    with pytest.raises(UsageError, match="'sometimes' is not a valid Recompute"):
        memory_options(recompute="sometimes")
    with pytest.raises(UsageError, match="--recompute auto needs --device-memory"):
        memory_options(recompute="auto")


def test_config_memory_table(tmp_path):
    good = tmp_path / "m.toml"
    good.write_text('[memory]\nzero = 1\nrecompute = "full"\n')
    cfg = load_config(str(good))
    assert cfg.memory == {"zero": 1, "recompute": "full"} and cfg.memory_source == f"{good}:1"
    bad = tmp_path / "bad.toml"
    bad.write_text('[params]\n\n[memory]\nzero = 1\nzer0 = 2\n')
    with pytest.raises(UsageError, match=r"\[memory\] has unknown key 'zer0'") as err:
        load_config(str(bad))
    assert err.value.location == f"{bad}:5"


def test_offload_from_the_config_table(tmp_path):
    """`offload = "optimizer"` in [memory] reaches the compiler (it was refused until built):
    the optimizer state lands in host memory, and none of it on the device."""
    from sbpc.cli import main
    from sbpc.runtime.kinds import MemoryKind
    from sbpc.runtime.plan import load_plan
    cfg = tmp_path / "off.toml"
    cfg.write_text('[memory]\noffload = "optimizer"\n')
    out = tmp_path / "plan.json"
    assert main(["compile", "examples/mlp.py", "--mesh", "1", "--config", str(cfg), "-o", str(out)]) == 0
    plan = load_plan(str(out))
    assert plan.states and {s.memory for s in plan.states} == {MemoryKind.HOST}
    assert plan.estimates.optimizer_state_bytes == 0 and plan.estimates.roles[0].host > 0
    with pytest.raises(UsageError, match="offload 'gpu' is not one of none, optimizer"):
        memory_options(offload="gpu")

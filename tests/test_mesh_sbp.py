"""Meshes, SBP values and --set parsing."""
import pytest

from sbpc.compiler.ir.mesh import Mesh, parse_mesh
from sbpc.compiler.frontend.model_loader import parse_sets
from sbpc.runtime.sbp import Broadcast, Partial, Split, format_nd_sbp, parse_sbp
from sbpc.errors import UsageError


@pytest.mark.parametrize("text,axes", [
    ("1", (("dp", 1),)),
    ("4x8", (("dp", 4), ("tp", 8))),
    ("4x8x4", (("pp", 4), ("dp", 4), ("tp", 8))),
    ("tp=2,dp=2", (("dp", 2), ("tp", 2))),
    ("dp=2,cp=2,tp=2,pp=2", (("pp", 2), ("dp", 2), ("cp", 2), ("tp", 2))),
])
def test_parse_mesh(text, axes):
    assert parse_mesh(text).axes == axes


def test_rank_order_pp_outermost_tp_innermost():
    mesh = parse_mesh("2x4x2")  # dp=2, tp=4, pp=2
    assert mesh.world_size == 16
    assert mesh.coords(0) == {"pp": 0, "dp": 0, "tp": 0}
    assert mesh.coords(1) == {"pp": 0, "dp": 0, "tp": 1}  # tp ranks are contiguous
    assert mesh.coords(4) == {"pp": 0, "dp": 1, "tp": 0}
    assert mesh.coords(8) == {"pp": 1, "dp": 0, "tp": 0}
    assert all(mesh.rank(c) == r for r, c in mesh.rank_map())
    assert mesh.sbp_axes == ("dp", "tp")


@pytest.mark.parametrize("text,message", [
    ("", "empty --mesh"), ("2x", "bad mesh size ''"), ("axb", "bad mesh size 'a'"),
    ("dp=2,ep=2", "unknown mesh axis 'ep'"), ("dp=0", "bad mesh size '0'"), ("2x2x2x2", "has 4 axes"),
])
def test_bad_meshes(text, message):
    with pytest.raises(UsageError, match=message) as err:
        parse_mesh(text)
    assert "hint:" in str(err.value)


def test_mesh_axes_must_be_in_rank_order():
    with pytest.raises(UsageError, match="out of rank order"):
        Mesh((("tp", 2), ("dp", 2)))


@pytest.mark.parametrize("text,value", [("S(0)", Split(0)), ("S(-1)", Split(-1)), ("B", Broadcast()),
                                        ("P", Partial()), ("P(max)", Partial("max")), (" B ", Broadcast())])
def test_parse_sbp(text, value):
    assert parse_sbp(text) == value
    assert repr(value) == text.strip()


@pytest.mark.parametrize("bad", ["S", "S(x)", "P(min)", "b", "Split(0)", ""])
def test_bad_sbp(bad):
    with pytest.raises(UsageError, match=r"bad SBP .*hint: write S\(dim\), S\(dim:blocks\), B, P or P\(max\)"):
        parse_sbp(bad)


def test_nd_sbp_is_hashable_and_prints_like_the_ir():
    nd = (Split(0), Broadcast())
    assert format_nd_sbp(nd) == "[S(0), B]"
    assert len({nd, (Split(0), Broadcast())}) == 1


def test_parse_sets():
    assert parse_sets(["layers=4", "preset=1t", "lr=3e-4", "bias=false", "name=a b", "dims=(1, 2)"]) == {
        "layers": 4, "preset": "1t", "lr": 3e-4, "bias": False, "name": "a b", "dims": (1, 2)}
    for bad in ["x", "=1", "1a=2"]:
        with pytest.raises(UsageError, match="bad --set"):
            parse_sets([bad])

"""Row-wise regions (compiler/sbp/rowwise.py): which values of a region are rows, partial sums
or whole, the regions the analysis refuses and why, the axes that split one, and the text IR.
The end-to-end proofs are the zoo's Mixtral and GPT-OSS checks (tests/test_zoo.py) and the
golden file tests/golden/sbp-propagate-rowwise.sbpir."""
import io

import pytest

from sbpc.compiler.ir.parser import parse_graph
from sbpc.compiler.ir.printer import print_graph
from sbpc.compiler.pass_manager import CompileContext
from sbpc.compiler.passes.sbp_propagate import SbpPropagate
from sbpc.compiler.sbp.rowwise import Kind, find_regions

HEAD = '''graph @moe mesh<{mesh}> rowwise<"moe"> {{
  input param %w : f32[6, 6] "moe.w"
  input batch %x : f32[{rows}, 6] "batch.0"
  input batch %ids : i64[{rows}, 2] "batch.1"
  %flat = aten.view.default(%ids, [-1]) : i64[{pairs}] {{role=fwd, loc="moe" @ "moe.py":1}}
  %sorted, %perm = aten.sort.default(%flat) : (i64[{pairs}], i64[{pairs}]) {{role=fwd, loc="moe" @ "moe.py":2}}
  %tok = aten.floor_divide.default(%perm, 2) : i64[{pairs}] {{role=fwd, loc="moe" @ "moe.py":3}}
  %g = aten.index.Tensor(%x, [%tok]) : f32[{pairs}, 6] {{role=fwd, loc="moe" @ "moe.py":4}}
  %f = aten._to_copy.default(%sorted, dtype=f32) : f32[{pairs}] {{role=fwd, loc="moe" @ "moe.py":5}}
  %counts = aten.histc.default(%f, 4, 0, 3) : f32[4] {{role=fwd, loc="moe" @ "moe.py":5}}
  %y = aten.mm.default(%g, %w) : f32[{pairs}, 6] {{role=fwd, loc="moe" @ "moe.py":6}}
'''
TAIL = '''  %l = aten.sum.default({out}) : f32[] {{role=fwd, loc="" @ "model.py":3}}
  output loss %l "loss"
}}
'''


def _graph(body: str = "", out: str = "%y", mesh: str = "dp=2", rows: int = 8):
    text = HEAD.format(mesh=mesh, rows=rows, pairs=2 * rows) + body + TAIL.format(out=out)
    return parse_graph(text)


def test_values_are_rows_partial_sums_or_whole():
    g = _graph()
    regions = find_regions(g, g.value_types())
    assert [r.module for r in regions.regions] == ["moe"] and regions.regions[0].rows == 8
    kind = regions.kind
    assert (kind["perm"], kind["g"], kind["y"]) == (Kind.ROW, Kind.ROW, Kind.ROW)
    assert kind["counts"] == Kind.PARTIAL and kind["w"] == Kind.WHOLE


@pytest.mark.parametrize("body,out,why", [
    # 16 is the row count of the top-k pairs: a scalar that equals it is not guessed at
    ('  %z = aten.mul.Tensor(%y, 16) : f32[16, 6] {role=fwd, loc="moe" @ "moe.py":7}\n', "%z",
     "aten.mul.Tensor has a row count in its arguments"),
    # a maximum over the rows leaves the region: not a sum, so no partial layout is exact
    ('  %m = aten.amax.default(%y, [0]) : f32[6] {role=fwd, loc="moe" @ "moe.py":7}\n', "%m",
     "aten.amax.default -> %m leaves it made from its rows but not as a sum over them"),
])
def test_a_region_that_does_not_fit_is_refused_with_why(body, out, why):
    g = _graph(body, out)
    regions = find_regions(g, g.value_types())
    assert not regions.regions and regions.refused == (("moe", why),)
    log = io.StringIO()
    result = SbpPropagate().apply(g, CompileContext(log=log))
    assert f"sbpc: note: moe is row-wise, but its ops are not split as one region: {why}" in log.getvalue()
    assert result.rowwise == ()  # its ops kept their own rules


def test_the_batch_axes_split_a_region_where_their_devices_divide_its_rows():
    """Micro-batches first (decided first), then dp while the devices still divide the rows;
    tp never splits a region."""
    g = _graph(mesh="pp=2, mb=2, dp=2, tp=2", rows=10)
    regions = find_regions(g, g.value_types())
    axes = g.mesh.sbp_axes
    assert regions.axes(regions.regions[0], axes, tuple(g.mesh.size(a) for a in axes)) == {axes.index("mb")}
    g = _graph(mesh="pp=2, mb=2, dp=2, tp=2", rows=8)
    assert regions.axes(find_regions(g, g.value_types()).regions[0], axes, (2, 2, 2)) == \
        {axes.index("mb"), axes.index("dp")}


def test_the_rowwise_header_round_trips():
    g = _graph()
    assert g.rowwise == ("moe",)
    assert print_graph(parse_graph(print_graph(g))) == print_graph(g)
    assert 'rowwise<"moe">' in print_graph(g)


def test_a_transposed_or_contracted_row_value_is_not_rows_though_its_dim_0_counts_as_many():
    """``y.t()`` has as many rows as the region (8 features, 8 tokens) and a matmul contracting
    the tokens gives a weight-gradient-like [8, 6]: neither is split by tokens."""
    g = parse_graph('''graph @moe mesh<dp=2> rowwise<"moe"> {
  input param %w : f32[6, 8] "moe.w"
  input batch %x : f32[8, 6] "batch.0"
  %y = aten.mm.default(%x, %w) : f32[8, 8] {role=fwd, loc="moe" @ "moe.py":1}
  %yt = aten.t.default(%y) : f32[8, 8] {role=fwd, loc="moe" @ "moe.py":2}
  %z = aten.mm.default(%yt, %x) : f32[8, 6] {role=fwd, loc="moe" @ "moe.py":3}
  %s = aten.transpose.int(%y, 1, 0) : f32[8, 8] {role=fwd, loc="moe" @ "moe.py":4}
  %r = aten.relu.default(%y) : f32[8, 8] {role=fwd, loc="moe" @ "moe.py":5}
  %l = aten.sum.default(%r) : f32[] {role=fwd, loc="" @ "model.py":3}
  output loss %l "loss"
}
''')
    kind = find_regions(g, g.value_types()).kind
    assert (kind["y"], kind["r"]) == (Kind.ROW, Kind.ROW)
    assert (kind["yt"], kind["z"], kind["s"]) == (Kind.PARTIAL, Kind.PARTIAL, Kind.PARTIAL)

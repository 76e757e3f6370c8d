"""Capture one layer, stamp out the copies (compiler/frontend/stamp.py, stamp_expand.py, repeated_layers.py).

The proof that stamping is right: the graph of a stamped capture is the graph of a whole
trace, node for node and name for name (so the plan is too), on every model and setting that
changes what a layer traces; and a layer stamping cannot follow is traced as it is.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from sbpc.compiler.frontend import capture as capture_module
from sbpc.compiler.frontend.capture import capture
from sbpc.compiler.frontend.hints import ParallelConfig, load_config
from sbpc.compiler.frontend.model_loader import load_model
from sbpc.compiler.frontend.optim import OptimizerConfig
from sbpc.compiler.frontend.repeated_layers import find_repeated
from sbpc.compiler.driver import precision_spec
from sbpc.compiler.ir.mesh import parse_mesh
from sbpc.compiler.ir.printer import print_graph
from sbpc.runtime.kinds import Precision

CASES = {
    "gpt": ("examples/gpt.py", {"layers": 5}, "1", None, "fp32"),
    "gpt-bf16-dropout": ("examples/gpt.py", {"layers": 5, "dropout": 0.1}, "1", None, "bf16"),
    "gpt-fp16": ("examples/gpt.py", {"layers": 4}, "1", None, "fp16"),
    "gpt-megatron-sp": ("examples/gpt.py", {"layers": 6, "sp": 1}, "2x2", "examples/gpt.megatron.toml", "fp32"),
    "gpt-stages": ("examples/gpt.py", {"layers": 6}, "1x1x2", "examples/gpt.pp.toml", "fp32"),
    "torch-encoder": ("tests/zoo/torch_decoder.py", {"layers": 5}, "2x2", None, "bf16"),
    # Hugging Face layers differ in `layer_idx` (read only with a KV cache) and hold their
    # rotary kernel in a per-layer helper module made by a factory
    "hf-llama-megatron": ("examples/hf_llama.py", {"layers": 4}, "2x2", "examples/hf_llama.megatron.toml", "fp32"),
    "hf-bert": ("tests/zoo/bert.py", {"layers": 4}, "1", None, "fp32"),
}


def _capture(path, sets, mesh, config, precision, stamp, stamped=None):
    cfg = load_config(config) if config else None
    return capture(load_model(path, dict(sets)), parse_mesh(mesh), 8, OptimizerConfig(), cfg,
                   precision_spec(Precision(precision)), stamp=stamp)


@pytest.fixture
def stamped_layers(monkeypatch):
    """The layers the next capture stamped (empty when it traced whole)."""
    seen: list[int] = []
    expand = capture_module.expand

    def spy(gm, stamper, names):
        out = expand(gm, stamper, names)  # NotStampable: nothing was stamped
        seen.extend(sorted(stamper.stamped))
        return out

    monkeypatch.setattr(capture_module, "expand", spy)
    return seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_stamped_capture_is_the_whole_trace(case, stamped_layers):
    path, sets, mesh, config, precision = CASES[case]
    whole = print_graph(_capture(path, sets, mesh, config, precision, stamp=False))
    assert not stamped_layers
    stamped = print_graph(_capture(path, sets, mesh, config, precision, stamp=True))
    assert stamped_layers == list(range(2, sets["layers"]))  # layers 0 and 1 traced, the rest stamped
    assert stamped == whole


def _write(tmp_path, body: str) -> str:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


_MODEL = """
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self, index):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.index = index

        def forward(self, x):
            {body}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer(i) for i in range(6))
            self.scale = nn.Parameter(torch.ones(16))

        def forward(self, x, y):
            global SHARED
            SHARED = self.scale * 2
            for layer in self.layers:
                x = layer(x)
            return ((x * self.scale - y) ** 2).mean()

    def build_model():
        return Net()

    def example_batch(batch_size):
        return torch.randn(batch_size, 16), torch.randn(batch_size, 16)
"""


def test_layers_that_differ_are_traced_whole(tmp_path, stamped_layers):
    """Copies whose plain attributes differ (here the index) are stamped only if layer 1's
    forward never reads those attributes: this one branches on it, so every layer is traced
    as it is."""
    path = _write(tmp_path, _MODEL.replace("{body}", "return self.fc(x) if self.index % 2 else torch.relu(self.fc(x))"))
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        repeated = find_repeated(load_model(path, {}).build(), ParallelConfig())
    assert repeated is not None and repeated.differ == {("", "index")}
    graph = _capture(path, {}, "1", None, "fp32", stamp=True)
    assert not stamped_layers
    ops = [n.op for n in graph.nodes if n.loc and n.loc.module.startswith("layers.")]
    assert ops.count("aten.relu.default") == 3
    assert print_graph(graph) == print_graph(_capture(path, {}, "1", None, "fp32", stamp=False))


def test_a_layer_reading_an_outside_value_is_traced_whole(tmp_path, stamped_layers):
    """Layer 1's ops read a value made outside the layer (a global the model sets): the copies
    could not be re-bound, so the model is traced whole, and correctly (the shared weight's
    gradient sums every layer's use)."""
    path = _write(tmp_path, _MODEL.replace("{body}", "return self.fc(x) * SHARED").replace("self.index = index", "self.index = 0"))
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        assert find_repeated(load_model(path, {}).build(), ParallelConfig()) is not None
    stamped = print_graph(_capture(path, {}, "1", None, "fp32", stamp=True))
    assert not stamped_layers  # tried, refused, traced again whole
    assert stamped == print_graph(_capture(path, {}, "1", None, "fp32", stamp=False))
    assert stamped.count("aten.mul.Tensor") >= 6 + 6  # every layer's use, and its gradient


_CALLED_ONE_BY_ONE = """
    import torch
    from torch import nn
    import sbpc

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))

        def forward(self, x, y):
            x = self.h[1](self.h[0](x))
            x = torch.relu(self.h[2](x))
            with sbpc.stage(1):
                x = self.h[4](self.h[3](x))
            return ((x - y) ** 2).mean()

    def build_model():
        return Net()

    def example_batch(batch_size):
        return torch.randn(batch_size, 16), torch.randn(batch_size, 16)
"""


def test_copies_take_their_own_call_site_and_stage(tmp_path, stamped_layers):
    """Layers called one by one, on other lines and in a stage scope: each copy's ops carry its
    own call's file:line (a torch layer's ops have no frame of the user's inside it) and chunk."""
    path = _write(tmp_path, _CALLED_ONE_BY_ONE)
    stamped = _capture(path, {}, "1x1x2", None, "fp32", stamp=True)
    assert stamped_layers == [2, 3, 4]
    assert print_graph(stamped) == print_graph(_capture(path, {}, "1x1x2", None, "fp32", stamp=False))
    lines = {n.loc.module: n.loc.line for n in stamped.nodes if n.role.value == "fwd" and n.loc and n.loc.module}
    assert lines["h.2"] == lines["h.1"] + 1 and lines["h.3"] == lines["h.4"] == lines["h.1"] + 3
    chunks = {n.loc.module: n.stage for n in stamped.nodes if n.role.value == "fwd" and n.loc and n.loc.module}
    assert chunks["h.3"] == chunks["h.4"] == 1 and chunks["h.2"] is None


_AUX_OF_THE_LAST = """
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x), torch.tanh(self.fc(x)).sum()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(5))

        def forward(self, x, y):
            for layer in self.layers:
                x, aux = layer(x)
            return ((x - y) ** 2).mean() + aux  # only the last layer's aux is differentiated

    def build_model():
        return Net()

    def example_batch(batch_size):
        return torch.randn(batch_size, 16), torch.randn(batch_size, 16)
"""


def test_an_output_only_a_later_copy_differentiates_is_traced_whole(tmp_path, stamped_layers):
    """Layer 1's second output gets no gradient, the last layer's does: a copy of layer 1's
    backward would drop it, so the model is traced whole, with the gradient."""
    path = _write(tmp_path, _AUX_OF_THE_LAST)
    stamped = print_graph(_capture(path, {}, "1", None, "fp32", stamp=True))
    assert not stamped_layers
    assert stamped == print_graph(_capture(path, {}, "1", None, "fp32", stamp=False))
    assert "aten.tanh_backward.default" in stamped

"""The bad-input corpus's rows about model files (tests/test_bad_input.py runs them): a model
file that is missing, does not import, breaks the model contract (``build_model``,
``example_batch``, a forward that returns no scalar loss), or cannot be traced."""
from __future__ import annotations

from bad_input_setups import Case, chain, recompiled_model, write

MODEL_FILE_CASES = [
    Case("model-missing", ["compile", "nope/missing.py"], "model file 'nope/missing.py' does not exist"),
    Case("model-syntax-error", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         ("syntax error in model file", "{tmp}/model.py:3"),
         write("model.py", "import torch\n\ndef build_model(:\n    pass\n")),
    Case("model-import-fails", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         ("No module named 'no_such_package'", "model.py:2"),
         write("model.py", "import torch\nimport no_such_package\n")),
    Case("model-no-build-model", ["compile", "tests/models/no_build.py"], "has no function build_model()"),
    Case("model-build-raises", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         ("build_model() failed", "model.py:4"),
         write("model.py", """
             import torch

             def build_model():
                 raise RuntimeError("out of ideas")

             def example_batch(batch_size):
                 return (torch.randn(batch_size, 4),)
             """)),
    Case("model-batch-not-tensors", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         "example_batch() in {tmp}/model.py must return a tensor, a tuple of tensors or a dict of them, got str",
         write("model.py", """
             import torch

             def build_model():
                 return torch.nn.Linear(4, 1)

             def example_batch(batch_size):
                 return "tokens"
             """)),
    Case("model-batch-dict-not-tensor", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         "example_batch() in {tmp}/model.py returned bool as 'use_cache'; every batch input must be a tensor",
         write("model.py", """
             import torch

             def build_model():
                 return torch.nn.Linear(4, 1)

             def example_batch(batch_size):
                 return {"input": torch.randn(batch_size, 4), "use_cache": False}
             """)),
    # a Hugging Face model given no labels: its output has no loss
    Case("model-output-without-loss", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         ("forward() must return the scalar loss, but returned Out without a loss (keys: logits)", "model.py:7"),
         write("model.py", """
             import torch

             class Out(dict):
                 pass

             class Net(torch.nn.Linear):
                 def forward(self, x):
                     return Out(logits=super().forward(x))

             def build_model():
                 return Net(4, 2)

             def example_batch(batch_size):
                 return {"x": torch.randn(batch_size, 4)}
             """)),
    # ... from a library's forward (Hugging Face's): the user's line is the batch without labels
    Case("model-library-output-without-loss", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         ("returned Out without a loss (keys: logits)", "model.py:7"),
         chain(write("lib.py", """
             import torch

             class Out(dict):
                 pass

             class Net(torch.nn.Linear):
                 def forward(self, x, labels=None):
                     return Out(logits=super().forward(x))
             """), write("model.py", """
             import torch
             from lib import Net

             def build_model():
                 return Net(4, 2)

             def example_batch(batch_size):
                 return {"x": torch.randn(batch_size, 4)}
             """))),
    Case("model-batch-unsupported-dtype", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         "tensors of dtype torch.uint16 are not supported yet",
         write("model.py", """
             import torch

             class Net(torch.nn.Module):
                 def __init__(self):
                     super().__init__()
                     self.emb = torch.nn.Embedding(16, 4)

                 def forward(self, ids):
                     return self.emb(ids.long()).sum()

             def build_model():
                 return Net()

             def example_batch(batch_size):
                 return (torch.zeros(batch_size, 8, dtype=torch.uint16),)
             """)),
    Case("model-batch-changed-since-compile", ["run", "{tmp}/plan.json", "--steps", "1"],
         "batch has 1 tensors, the plan takes 2", lambda tmp: recompiled_model(tmp)),
    Case("model-forward-not-scalar", ["compile", "tests/models/not_scalar.py", "-o", "{tmp}/p.json"],
         "forward() must return the scalar loss, but returned a tensor of shape [4, 2] (at tests/models/not_scalar.py:9)"),
    Case("model-data-dependent-if", ["compile", "tests/models/data_dependent.py", "-o", "{tmp}/p.json"],
         "cannot trace forward(): data-dependent control flow (at tests/models/data_dependent.py:11)"),
    # a check of the labels in a library the model calls (Hugging Face's CTC heads): the line that
    # reads the value is named, then the user's
    Case("model-data-dependent-in-a-library", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         "cannot trace forward(): data-dependent control flow at {tmp}/heads.py:4 (at {tmp}/model.py:9)",
         chain(write("heads.py", """
             import torch

             def loss(logits, labels):
                 if labels.max() >= logits.shape[-1]:
                     raise ValueError("label out of range")
                 return torch.nn.functional.cross_entropy(logits, labels)
             """), write("model.py", """
             import torch
             import heads

             class Net(torch.nn.Module):
                 def __init__(self):
                     super().__init__()
                     self.fc = torch.nn.Linear(4, 3)
                 def forward(self, x, labels):
                     return heads.loss(self.fc(x), labels)

             def build_model():
                 return Net()

             def example_batch(batch_size):
                 return torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,))
             """))),
    Case("model-value-dependent-shape", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         ("cannot trace forward(): aten.nonzero.default makes a tensor whose shape depends on tensor values "
          "(at {tmp}/model.py:8)", "keep shapes static"),
         write("model.py", """
             import torch

             class Net(torch.nn.Module):
                 def __init__(self):
                     super().__init__()
                     self.fc = torch.nn.Linear(4, 4)
                 def forward(self, x):
                     return self.fc(x)[x > 0].sum()  # the selected count depends on x

             def build_model():
                 return Net()

             def example_batch(batch_size):
                 return (torch.randn(batch_size, 4),)
             """)),
    # ... and in a library (Hugging Face's CTC loss flattens the labels with masked_select); a module
    # name of its own, as in-process cases share sys.modules
    Case("model-value-dependent-shape-in-a-library", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         ("cannot trace forward(): aten.masked_select.default makes a tensor whose shape depends on tensor "
          "values at {tmp}/ctc_targets.py:4 (at {tmp}/model.py:9)"),
         chain(write("ctc_targets.py", """
             import torch

             def loss(logits, labels):
                 targets = labels.masked_select(labels >= 0)
                 return logits.sum() + targets.sum()
             """), write("model.py", """
             import torch
             import ctc_targets

             class Net(torch.nn.Module):
                 def __init__(self):
                     super().__init__()
                     self.fc = torch.nn.Linear(4, 3)
                 def forward(self, x, labels):
                     return ctc_targets.loss(self.fc(x), labels)

             def build_model():
                 return Net()

             def example_batch(batch_size):
                 return torch.randn(batch_size, 4), torch.randint(-1, 3, (batch_size,))
             """))),
    Case("model-embedding-max-norm", ["compile", "{tmp}/model.py", "-o", "{tmp}/p.json"],
         ("forward() updates param 'emb.weight' through a view (aten.embedding_renorm_.default) (at emb @ "
          "{tmp}/model.py:8)", "nn.Embedding(max_norm=...) renormalizes the rows it looks up in place: drop max_norm"),
         write("model.py", """
             import torch

             class Net(torch.nn.Module):
                 def __init__(self):
                     super().__init__()
                     self.emb = torch.nn.Embedding(10, 4, max_norm=1.0)
                 def forward(self, ids):
                     return self.emb(ids).square().mean()

             def build_model():
                 return Net()

             def example_batch(batch_size):
                 return (torch.randint(0, 10, (batch_size, 3)),)
             """)),
    Case("model-buffer-written-through-a-view", ["compile", "tests/models/buffer_view_write.py", "-o", "{tmp}/p.json"],
         ("forward() updates buffer 'seen' through a view (aten.add_.Tensor) "
          "(at tests/models/buffer_view_write.py:13)", "write the whole buffer")),
    Case("model-moe-grouped-mm", ["compile", "tests/models/moe_grouped_mm.py", "-o", "{tmp}/p.json"],
         ("cannot trace forward(): RuntimeError", "(in aten._grouped_mm.default) (at tests/models/moe_grouped_mm.py:17)",
          "does not support MoE layers yet")),
    Case("model-buffer-update-with-micro-batches", ["compile", "tests/models/mlp_bn.py", "--mesh", "1x1x2",
                                                    "--microbatches", "2", "-o", "{tmp}/p.json"],
         ("forward() updates buffer", "not supported with 2 micro-batches yet", "--microbatches 1")),
    Case("model-converts-built-module", ["compile", "tests/models/to_dtype.py", "-o", "{tmp}/p.json"],
         ("build_model() failed", "Couldn't swap Linear.weight (at tests/models/to_dtype.py:9)",
          "create the parameters in their dtype instead")),
]

"""The SBP rule engine: the signatures of each op on one mesh axis, and their per-device form.

The rules are declarative text in ``ir_specs/aten.sbp`` (grammar ``ir_specs/sbp_rules.lark``);
the pieces live in ``compiler/rules/``: ``dsl`` parses, ``loops``, ``families`` and ``vocab``
(masked vocab-parallel ops, losses) turn a rule into signatures, ``book`` is the API below,
``validate`` proves rules by execution.
"""
from sbpc.compiler.rules.book import DEFAULT_STRIDED_PARTS, RuleBook, Signature, op_params, use_keys

__all__ = ["RuleBook", "Signature", "DEFAULT_STRIDED_PARTS", "op_params", "use_keys"]

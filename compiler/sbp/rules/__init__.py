"""SBP rules: the DSL parser, the families, the rule book and the validator (see docs/sbp_rules.md).

The rules are declarative text in ``ir_specs/aten.sbp`` (grammar ``ir_specs/sbp_rules.lark``):
``dsl`` parses, ``loops``, ``families`` and ``vocab`` (masked vocab-parallel ops, losses) turn a
rule into signatures, ``book`` is the API re-exported here, ``validate`` proves rules by execution.
"""
from sbpc.compiler.sbp.rules.book import DEFAULT_STRIDED_PARTS, RuleBook, Signature, op_params, use_keys

__all__ = ["RuleBook", "Signature", "DEFAULT_STRIDED_PARTS", "op_params", "use_keys"]

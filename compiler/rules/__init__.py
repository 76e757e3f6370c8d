"""SBP rules: the DSL parser, the families, the rule book and the validator (see docs/sbp_rules.md)."""

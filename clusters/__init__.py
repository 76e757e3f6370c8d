"""Cluster presets for ``sbpc simulate --cluster NAME`` (TOML; schema in compiler/tools/cluster.py)."""

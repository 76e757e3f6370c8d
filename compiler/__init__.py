"""The sbpc compiler: capture, IR, passes and lowering to a physical plan."""

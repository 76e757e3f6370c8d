"""sbpc: compile a single-device PyTorch training program into a distributed plan."""
__version__ = "0.1.0"

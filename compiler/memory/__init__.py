"""The memory estimate per rank role and what to change when a plan does not fit."""

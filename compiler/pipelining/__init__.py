"""Pipelining: the stage policy (cost-balanced partition) and the schedule simulation with its deadlock proof."""

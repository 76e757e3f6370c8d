"""SBP: layouts and candidate signatures, the cost model, the solver's refinement moves, boxing plans, layer classes and the rule book (rules/)."""

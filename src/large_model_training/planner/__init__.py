"""Strategy planning: FLOP and memory formulas, hardware catalogue, timing simulation, layout search."""

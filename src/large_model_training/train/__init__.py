"""Training loop, optimizer and schedule, checkpoints, metrics and sampling."""

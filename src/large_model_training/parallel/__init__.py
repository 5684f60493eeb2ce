"""Parallelism applied to a single-device model: tensor, pipeline and data parallel."""

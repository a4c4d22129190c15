"""Benchmarks that print JSON (``chorus bench ...``)."""

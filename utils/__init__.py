"""Tooling around the package: the benchmark, the real-model assets, the registry page."""

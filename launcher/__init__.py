"""Command-line entry points: the tiny test model and the local cluster launcher."""

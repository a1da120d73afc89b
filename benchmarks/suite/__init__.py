"""The benchmark suite behind ``python -m benchmarks.run``: variants, rank workers,
report and plots. See benchmarks/README.md."""

"""The benchmark suite behind ``python -m benchmarks.run`` (issue 7): variants, rank workers,
report and plots. See benchmarks/README.md."""

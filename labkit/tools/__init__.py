"""Command-line tools run from a shell: the `labkit` CLI, the benchmark and the soak test."""

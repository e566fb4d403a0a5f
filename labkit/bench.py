"""`python -m labkit.bench`: the benchmark (it lives in labkit.tools.bench)."""

from labkit.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main())

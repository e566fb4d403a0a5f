"""`python -m labkit.soak`: the soak test (it lives in labkit.tools.soak)."""

from labkit.tools.soak import main

if __name__ == "__main__":
    raise SystemExit(main())

"""labkit: a Jupyter-driven lab for learning and debugging PyTorch parallelism."""

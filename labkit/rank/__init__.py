"""Code that runs in a rank process (or in the fork server, the ranks' parent): the worker
that serves cells, fd capture, comm tracing, the placement probe and the torchrun entry point.

Rank-side code never imports IPython, ipywidgets, plotly or anywidget, nor `labkit.kernel` or
`labkit.views` (tests/test_layout.py checks it), so a cluster node needs only the rank's
dependencies.
"""

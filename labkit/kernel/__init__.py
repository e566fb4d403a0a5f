"""Code that runs in the notebook kernel: the `Lab` and its public API (`lab.py`, `lab_data.py`,
`script_run.py`), what comes back from the ranks (`results.py`) and the magics (`magics.py`),
over its parts, one folder per job: `channel/` (the channel to the ranks and its transports),
`launch/` (how ranks come to exist), `cell/` (one cell's run, Stop, watchdog and live status)
and `inspection/` (stacks, pdb, Flight Recorder, profiling, logs). Imports go one way, from the
magics down to results (docs/layout.md; tests/test_layout.py checks it).

Nothing here runs in a rank; the rank side (`labkit.rank`) never imports this package.
"""

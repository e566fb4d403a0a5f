"""Code that runs in the notebook kernel: the lab, its channel to the ranks, one cell's run,
the launchers that start ranks, the watchdog, results, output, live status and the magics.

Nothing here runs in a rank; the rank side (`labkit.rank`) never imports this package.
"""

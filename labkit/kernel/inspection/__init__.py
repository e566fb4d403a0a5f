"""Looking into the ranks from the notebook (kernel side).

`stacks.py`: every rank's Python stacks; `debug.py`: the notebook's end of pdb on a rank;
`flight_recorder.py`: torch's Flight Recorder per rank (`labkit.flight_recorder`);
`hang_verdict.py`: every rank's Flight Recorder merged into a verdict (pure; stacks.py and
flight_recorder.py use it); `profiling.py`: a cell under torch.profiler (`labkit.profile`);
`logs.py` and `log_dirs.py`: the ranks' log files and where they are kept. Each takes a lab or
its replies as arguments and imports no other part of the kernel side but
`labkit.kernel.results` (and, for the verdict, `hang_verdict`).
"""

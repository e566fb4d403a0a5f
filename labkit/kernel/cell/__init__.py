"""One cell on the ranks, from sending it to its results (kernel side).

`cell_run.py`: a cell's run, Stop and recovery; `watchdog.py`: deciding a running cell can never
finish (pure); `live.py`: the live status of a running cell; `rank_spec.py`: which ranks a cell
runs on ("0,2", "1-3"); `commands.py`: a command such as torchrun run from a cell, its whole
process tree ended on Stop (`labkit.run_command`).
"""

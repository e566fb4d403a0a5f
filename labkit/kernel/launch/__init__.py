"""How a lab's ranks come to exist, and on which backend and device (kernel side).

`launcher.py`: the one interface; `forked.py` and `spawn.py`: ranks forked on this machine by a
fork server; `attached.py`: ranks started by torchrun that attach to the lab; `policy.py`: the
backend and device chosen, and checks of what a user asked for.
"""

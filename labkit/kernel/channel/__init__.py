"""The kernel's channel to its ranks and its transports (kernel side).

`channel.py`: the two sockets, the I/O thread and the one waiting loop that sees replies,
output, deaths, the watchdog and Ctrl-C; `direct.py`: forked ranks' ctrl links over one Unix
socket; `side_io.py`: the side channel's I/O thread; `admission.py`: who may talk to the lab
over TCP; `sigint.py`: Ctrl-C held back while a link is read or written; `output.py`: what the
ranks print during a call, as the notebook shows it.
"""

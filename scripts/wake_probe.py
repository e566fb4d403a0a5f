"""How long waking N idle processes takes, two ways (a developers' tool, no labkit).

    python scripts/wake_probe.py [--procs 4] [--cells 400] [--rounds 3]

N plain processes wait in epoll; after 20 ms of quiet the parent wakes them either with one
socket write each (as the kernel sends a cell's request to each rank) or with one `eventfd`
write that all of them wait on (edge-triggered, so each is woken once per write), and each
answers with one socket write. Prints, per round, the median in microseconds from the wake-up
to the last answer, for both ways in turn. The parent ends its children by pid.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import statistics
import time

QUIET_S = 0.02


def _child(sock: socket.socket, efd: int, by_eventfd: bool) -> None:
    ep = select.epoll()
    ep.register(efd if by_eventfd else sock.fileno(), select.EPOLLIN | select.EPOLLET)
    while True:
        ep.poll()
        if not by_eventfd and not sock.recv(4096):
            os._exit(0)
        sock.send(b"x" * 100)


def median_us(procs: int, cells: int, by_eventfd: bool) -> float:
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    links, pids = [], []
    try:
        for _ in range(procs):
            mine, theirs = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                mine.close()
                _child(theirs, efd, by_eventfd)
            theirs.close()
            links.append(mine)
            pids.append(pid)
        ep = select.epoll()
        for link in links:
            ep.register(link.fileno(), select.EPOLLIN)
        times = []
        for _ in range(cells):
            time.sleep(QUIET_S)
            t0 = time.perf_counter()
            if by_eventfd:
                os.eventfd_write(efd, 1)
            else:
                for link in links:
                    link.send(b"y" * 200)
            answered = 0
            while answered < procs:
                for fd, _ in ep.poll():
                    os.read(fd, 4096)
                    answered += 1
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    finally:
        for link in links:
            link.close()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(efd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--cells", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    for _ in range(args.rounds):
        sock = median_us(args.procs, args.cells, by_eventfd=False)
        efd = median_us(args.procs, args.cells, by_eventfd=True)
        print(f"a socket write each {sock:.0f} us, one eventfd write {efd:.0f} us", flush=True)


if __name__ == "__main__":
    main()

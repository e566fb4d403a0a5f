"""Who may talk to a lab over TCP, and which `attach` is welcome (kernel side).

A mixin of `Channel` (labkit.kernel.channel.channel). Every rank's replies are taken only from the
route (ZeroMQ connection) its signed `hello` or `attach` came over (`_from_its_route`). For
ranks started by torchrun, also:

- `allow`: the networks ranks may connect from (`Lab.attach(..., allow=[...])`). A message from
  another address (ZeroMQ's `Peer-Address`) is dropped before its signature is read, counted in
  `rejected` and warned of.
- an `attach` is welcome only while `Lab.attach` waits (`attaching`) and only once per rank:
  a second process claiming an attached rank, or a rank that comes after the lab stopped
  waiting, is answered `refused` (it exits saying why), and the kernel warns.
"""

from __future__ import annotations

import ipaddress
import socket
import warnings
from collections.abc import Callable
from typing import Any

import zmq

from labkit.kernel.results import LabkitWarning
from labkit.wire.messages import Refused

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_allow(hosts: list[str] | str | None) -> list[Network] | None:
    """Networks from addresses ("10.0.0.5"), networks ("10.0.0.0/24") or host names."""
    if hosts is None:
        return None
    if isinstance(hosts, str):
        hosts = [hosts]
    nets: list[Network] = []
    for h in hosts:
        try:
            nets.append(ipaddress.ip_network(h, strict=False))
            continue
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)
        except OSError:
            raise ValueError(
                f"allow: {h!r} is neither an address, a network (such as 10.0.0.0/24) nor a "
                "host name this machine can resolve"
            ) from None
        nets.extend(ipaddress.ip_network(i[4][0]) for i in infos)
    return nets


class Admission:
    """Checks a `Channel` makes on what arrives over TCP (see the module docstring)."""

    allow: list[Network] | None
    attaching: bool
    rejected: int
    routes: dict[int, bytes]
    codec: Any
    ctrl: Any  # a ZeroMQ ROUTER, or a DirectRouter (labkit.kernel.channel.direct)
    _post: Callable[..., None]  # SideIO's

    def _from_its_route(self, msg: dict[str, Any], ident: bytes) -> bool:
        """Whether `msg` came over the route its rank signed in from (a hello or attach sets it).

        A `fatal` may come before the hello (a rank that could not start): it is let through.
        """
        rank, known = msg.get("rank"), self.routes.get(msg.get("rank", -1))
        if msg["type"] == "attach":
            return self._admit(msg, ident, known)
        if msg["type"] == "hello" and known is None:
            self.routes[rank] = ident
            return True
        if known == ident or (known is None and msg["type"] == "fatal"):
            return True
        self.rejected += 1
        warnings.warn(
            f"labkit dropped a {msg['type']!r} that claims to be from rank {rank} but came "
            "over another connection than the one that rank signed in from",
            LabkitWarning,
            stacklevel=5,
        )
        return False

    def _admit(self, msg: dict[str, Any], ident: bytes, known: bytes | None) -> bool:
        """An `attach` while the lab waits for it, from a rank not attached yet; else refused."""
        if self.attaching and known in (None, ident):
            self.routes[msg["rank"]] = ident
            return True
        why = (
            f"rank {msg['rank']} attached already from another process: two torchrun jobs, "
            "or two nodes with the same --node-rank, use this lab's key"
            if self.attaching
            else "the lab is not waiting for ranks (all attached, or it gave up or stopped): "
            "this rank came late; call Lab.attach(...) again and rerun the command it prints"
        )
        self.refuse(ident, why)
        self.rejected += 1
        where = f"{msg.get('host')} (pid {msg.get('pid')})"
        text = f"labkit turned away rank {msg['rank']} from {where}: {why}"
        warnings.warn(text, LabkitWarning, stacklevel=6)
        return False

    def refuse(self, ident: bytes, why: str) -> None:
        """Tell the process behind a ctrl route to go away, with why (it exits saying so)."""
        self.ctrl.send_multipart([ident, *self.codec.encode(Refused(type="refused", why=why))])

    def _allowed(self, frame: zmq.Frame, warn: bool) -> bool:
        """Whether a message came from a host in `allow` (always, where there is no `allow`)."""
        if self.allow is None:
            return True
        addr = frame.get("Peer-Address")
        if addr and any(ipaddress.ip_address(addr) in net for net in self.allow):
            return True
        self.rejected += 1
        why = f"it came from {addr}, not one of the hosts this lab accepts ({self.allow_text})"
        if warn:
            warnings.warn(f"labkit rejected a message: {why}", LabkitWarning, stacklevel=5)
        else:
            self._post("rejected", why)
        return False

    @property
    def allow_text(self) -> str:
        return ", ".join(str(n) for n in self.allow or ())

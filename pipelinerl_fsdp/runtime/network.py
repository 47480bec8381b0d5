"""Checks of a multi-node launch, run by run_train.sh on every node before torchrun, for the mistakes torch names
late or not at all (measured on two network namespaces, docs/cluster.md):

- a rendezvous host that does not resolve or cannot be reached: torchrun retries its store connection for 60 s
  (an address nobody has: 69 s) or longer (a name that does not resolve: 2 min), then fails with
  "The connection to the C10d store has failed";
- gloo's interface: with GLOO_SOCKET_IFNAME unset gloo listens on the address the hostname resolves to, and falls
  back to the loopback when there is none; a loopback address (Debian's `127.0.1.1 hostname` line, or
  GLOO_SOCKET_IFNAME=lo) cannot be reached from another node, and the job then fails with "Connection refused" in
  connectFullMesh, naming neither the interface nor the hostname.

    python -m pipelinerl_fsdp.runtime.network HOST:PORT     # exit 2 with the problem named, 0 when none

Standard library only (it runs before anything heavy is imported)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
import time
from pathlib import Path

# errors of a connect() that say the host cannot be reached at all (not "nobody listens there yet")
UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN, errno.EADDRNOTAVAIL}


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (or [V6]:PORT) into its parts; a malformed endpoint is a ValueError naming it."""
    host, sep, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"RDZV_ENDPOINT={endpoint!r} is not HOST:PORT")
    return host, int(port)


def is_loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr.split("%")[0]).is_loopback


def resolve(host: str, port: int = 0, tries: int = 3, wait_s: float = 1.0) -> list[str]:
    """The addresses `host` resolves to (a temporary resolver failure is retried `tries` times); raises
    socket.gaierror when it does not resolve."""
    for attempt in range(tries):
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            return list(dict.fromkeys(info[4][0] for info in infos))
        except socket.gaierror as e:
            if e.errno != socket.EAI_AGAIN or attempt == tries - 1:
                raise
            time.sleep(wait_s)
    raise AssertionError("unreachable")


def connect_error(addr: str, port: int, timeout_s: float) -> str | None:
    """Why a TCP connection to addr:port cannot be made from here (None: it can, or the host refused it: it is
    reachable and its torchrun agent is not listening yet, which torchrun itself waits for)."""
    t0 = time.monotonic()
    try:
        socket.create_connection((addr, port), timeout=timeout_s).close()
    except TimeoutError:  # socket.timeout
        return f"no answer in {timeout_s:.0f} s"
    except OSError as e:
        if e.errno == errno.ECONNREFUSED:
            return None
        if e.errno in UNREACHABLE:
            return f"{os.strerror(e.errno)} (after {time.monotonic() - t0:.1f} s)"
        return f"{e}"
    return None


def rendezvous_problem(endpoint: str, timeout_s: float = 10.0) -> str | None:
    """Why this node cannot join the c10d rendezvous at `endpoint`, or None. The node that hosts it connects to
    itself: refused until its agent listens, which passes."""
    host, port = split_endpoint(endpoint)
    here = socket.gethostname()
    try:
        addrs = resolve(host, port)
    except socket.gaierror as e:
        return f"RDZV_ENDPOINT={endpoint}: the host {host!r} does not resolve on {here} ({e.strerror})"
    errors = []
    for a in addrs:
        why = connect_error(a, port, timeout_s)
        if why is None:
            return None
        errors.append(f"{a}: {why}")
    return f"RDZV_ENDPOINT={endpoint}: {here} cannot reach the rendezvous host {host!r} ({'; '.join(errors)})"


def interface_flags(name: str) -> int:
    """The interface's flags (IFF_*) as the kernel reports them under /sys/class/net."""
    return int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)


def interface_problem(ifname: str | None, hostname: str | None = None) -> str | None:
    """Why gloo would listen where other nodes cannot reach it, or None. `ifname`: GLOO_SOCKET_IFNAME (a
    comma-separated list; None or empty: gloo uses the address `hostname` resolves to)."""
    names = [n for n in (ifname or "").split(",") if n]
    if names:
        present = sorted(n for _, n in socket.if_nameindex())
        for n in names:
            if n not in present:
                return f"GLOO_SOCKET_IFNAME={ifname}: no interface {n!r} on this node (it has: {', '.join(present)})"
        for n in names:
            if interface_flags(n) & 0x8:  # IFF_LOOPBACK
                return (
                    f"GLOO_SOCKET_IFNAME={ifname}: {n!r} is the loopback, which ranks on other nodes cannot reach; "
                    f"name the interface the nodes share (IFNAME=...; this node has: {', '.join(present)})"
                )
        return None
    hostname = hostname or socket.gethostname()
    try:
        addrs = resolve(hostname)
    except socket.gaierror as e:
        return (
            f"the hostname {hostname!r} does not resolve ({e.strerror}) and GLOO_SOCKET_IFNAME is unset: gloo would "
            "fall back to the loopback, which other nodes cannot reach; set IFNAME (or GLOO_SOCKET_IFNAME)"
        )
    if all(is_loopback(a) for a in addrs):
        return (
            f"the hostname {hostname!r} resolves to {', '.join(addrs)} (loopback) and GLOO_SOCKET_IFNAME is unset: "
            "gloo would listen where other nodes cannot reach it; set IFNAME (or GLOO_SOCKET_IFNAME) to the "
            "interface the nodes share, or fix the hostname's line in /etc/hosts"
        )
    return None


def launch_problem(endpoint: str, ifname: str | None) -> str | None:
    """The rendezvous check, then gloo's interface unless the rendezvous is on the loopback (every node on this
    machine: the loopback is then what the ranks share, as in the tests' two-agent jobs)."""
    problem = rendezvous_problem(endpoint)
    if problem:
        return problem
    host, port = split_endpoint(endpoint)
    if all(is_loopback(a) for a in resolve(host, port)):
        return None
    return interface_problem(ifname)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m pipelinerl_fsdp.runtime.network HOST:PORT", file=sys.stderr)
        return 2
    try:
        problem = launch_problem(argv[0], os.environ.get("GLOO_SOCKET_IFNAME"))
    except ValueError as e:
        problem = str(e)
    if problem:
        print(f"launch error: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

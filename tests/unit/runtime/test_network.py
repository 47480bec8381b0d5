"""The multi-node launch checks (runtime/network.py): each mistake named, each good setup passed. The unreachable
and silent hosts are the kernel's answers, raised by a stand-in connect (docs/cluster.md has them measured on two
network namespaces)."""

from __future__ import annotations

import errno
import socket

import pytest

from pipelinerl_fsdp.runtime import network


def test_endpoint_parts_and_a_malformed_endpoint_named():
    assert network.split_endpoint("node0:29500") == ("node0", 29500)
    assert network.split_endpoint("[fe80::1]:1") == ("fe80::1", 1)
    for bad in ("node0", "node0:", ":29500", "node0:port", "node0:70000"):
        with pytest.raises(ValueError, match="is not HOST:PORT"):
            network.split_endpoint(bad)


def test_a_rendezvous_host_that_does_not_resolve_is_named(monkeypatch):
    def no_name(*a, **k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_name)
    problem = network.rendezvous_problem("node9:29500")
    assert problem and "'node9' does not resolve" in problem and "Name or service not known" in problem


def test_the_host_of_the_rendezvous_and_a_host_that_refuses_pass():
    # the node that hosts the store connects to itself before its agent listens: refused, passed
    assert network.rendezvous_problem("127.0.0.1:1") is None
    # a refused connection: the host answers, its agent not up yet (torchrun waits for that itself)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert network.connect_error("127.0.0.1", port, 2.0) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert network.connect_error("127.0.0.1", s.getsockname()[1], 2.0) is None


@pytest.mark.parametrize(
    "raised, named",
    [
        (OSError(errno.EHOSTUNREACH, "No route to host"), "No route to host"),
        (OSError(errno.ENETUNREACH, "Network is unreachable"), "Network is unreachable"),
        (TimeoutError("timed out"), "no answer in 10 s"),
    ],
)
def test_an_unreachable_rendezvous_host_is_named(monkeypatch, raised, named):
    monkeypatch.setattr(network, "resolve", lambda host, port=0: ["10.77.0.9"])

    def connect(*a, **k):
        raise raised

    monkeypatch.setattr(socket, "create_connection", connect)
    problem = network.rendezvous_problem("node9:29500")
    assert problem and "cannot reach the rendezvous host 'node9'" in problem and named in problem


def test_gloo_interfaces_other_nodes_cannot_reach_are_named():
    assert "no interface 'ib9'" in network.interface_problem("ib9")
    assert "no interface 'ib9'" in network.interface_problem("lo,ib9")
    assert "'lo' is the loopback" in network.interface_problem("lo")
    # unset: the hostname's address; one that resolves to the loopback only (Debian's 127.0.1.1 line) is named
    assert "resolves to" in network.interface_problem(None, hostname="localhost")
    others = [n for _, n in socket.if_nameindex() if not network.interface_flags(n) & 0x8]
    if others:
        assert network.interface_problem(others[0]) is None


def test_a_hostname_that_does_not_resolve_is_named(monkeypatch):
    def no_name(*a, **k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_name)
    assert "'node7' does not resolve" in network.interface_problem("", hostname="node7")


def test_every_node_on_this_machine_may_share_the_loopback(monkeypatch):
    """A rendezvous on the loopback (several agents on one machine, as the tests run them): the loopback is what
    they share, so a hostname resolving to it is fine."""
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    assert network.launch_problem("127.0.0.1:29500", None) is None
    assert network.launch_problem("127.0.0.1:29500", "ib9") is None

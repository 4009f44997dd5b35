"""Nodes as network namespaces: each with its own address on a private bridge, running torchrun with
``--nnodes N --node-rank I`` against node 0's address. Within a node the ranks talk over the node's own address
(loopback); between nodes over the bridge: a socket's two ends tell the link class apart.

The bridge, namespaces and veths are named by this process's pid and a serial (tests/support/k8s_sim.Network),
so tests running at once never share one, and a network left by a killed test is removed by the next one.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from support import ROOT
from support.cli import bin_path
from support.k8s_sim import Network, _ip, make_bridge, sweep_orphans, teardown

SUBNET = "10.233.0"  # the first three octets; each bridge is its own link, unreachable from the host
MASTER_PORT = 29500  # inside node 0's own network namespace: no other test's port


@dataclass(frozen=True)
class Nodes:
    net: Network
    count: int

    def ns(self, index: int) -> str:
        return f"{self.net.ns_prefix}node{index}"

    def ip(self, index: int) -> str:
        return f"{SUBNET}.{10 + index}"

    def torchrun(
        self, nproc: int, target: Sequence[str], env: dict[str, str], timeout: float
    ) -> list[subprocess.CompletedProcess[str]]:
        """``torchrun -m TARGET`` on every node at once (static rendezvous at node 0), each node's result."""

        def one(index: int) -> subprocess.CompletedProcess[str]:
            cmd = ["ip", "netns", "exec", self.ns(index), bin_path("torchrun"), f"--nnodes={self.count}"]
            cmd += [f"--nproc-per-node={nproc}", f"--node-rank={index}", f"--master-addr={self.ip(0)}"]
            cmd += [f"--master-port={MASTER_PORT}", *target]
            node_env = {**env, "GLOO_SOCKET_IFNAME": "eth0"}
            return subprocess.run(cmd, env=node_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)

        with ThreadPoolExecutor(self.count) as pool:
            return list(pool.map(one, range(self.count)))


def _add_node(nodes: Nodes, index: int) -> None:
    ns, host_end, node_end = nodes.ns(index), nodes.net.veth(index, "v"), nodes.net.veth(index, "p")
    _ip("netns", "add", ns)
    _ip("link", "add", host_end, "type", "veth", "peer", "name", node_end)
    _ip("link", "set", host_end, "master", nodes.net.bridge, "up")
    _ip("link", "set", node_end, "netns", ns)
    _ip("-n", ns, "link", "set", node_end, "name", "eth0")
    _ip("-n", ns, "addr", "add", f"{nodes.ip(index)}/24", "dev", "eth0")
    _ip("-n", ns, "link", "set", "eth0", "up")
    _ip("-n", ns, "link", "set", "lo", "up")


@contextmanager
def netns_nodes(count: int) -> Iterator[Nodes]:
    """``count`` nodes on a bridge of their own, removed (with whatever still runs in them) on exit."""
    sweep_orphans()
    nodes = Nodes(Network(SUBNET), count)
    try:
        make_bridge(nodes.net)
        for index in range(count):
            _add_node(nodes, index)
        yield nodes
    finally:
        teardown(nodes.net)

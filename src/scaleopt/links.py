"""A cluster of shaped links on one machine: nodes in network namespaces of their own, joined
through a switch by links of a set rate (and delay and loss, where the kernel has netem).

    with ShapedCluster(nodes=2, rate="100mbit") as cluster:
        for rank in range(4):          # 2 ranks per node
            subprocess.Popen(cluster.command(rank // 2, [sys.executable, "train.py"]),
                             env={**os.environ, **cluster.environment(rank // 2)})

Each node is a namespace with one interface, ``eth0`` (address ``10.0.0.<node + 1>``), the
end of a veth pair whose other end is a port of a bridge in a switch namespace. The rate is
set with a token bucket filter (``tbf``) on both ends, so what a node sends and what it
receives each pass one shaped link; delay and loss with ``netem`` under it. Traffic between
ranks of one node stays inside its namespace (its own address is local) and is not shaped;
traffic between nodes is. :meth:`ShapedCluster.cut` takes a node's link down at the switch
and :meth:`ShapedCluster.restore` brings it back.

Making and removing namespaces needs root and the ``ip`` and ``tc`` tools (iproute2);
:func:`unavailable` says why a cluster cannot be made here, :func:`netem_unavailable` why
delay and loss cannot. Every namespace the cluster made (and its ``/etc/netns`` hosts file,
naming the nodes ``node<k>``) is removed when it closes, on an error too, and :func:`sweep`
removes those of processes that no longer exist. Addresses exist only inside the namespaces
made.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Sequence

#: the names of every namespace made here begin with it, then the maker's process id
PREFIX = "scaleopt-"
#: the interface of a node and the first three parts of its address
INTERFACE, SUBNET = "eth0", "10.0.0"
#: where ``ip netns exec`` finds a namespace's own /etc files
ETC = "/etc/netns"
_COUNTER = itertools.count()
_CLONE_NEWNET = 0x40000000
_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


class LinkError(RuntimeError):
    """A namespace, link or queue could not be made or changed: the command and its error."""


def rate_bits(rate: str) -> float:
    """Bits per second of a rate as tc writes it (``10mbit``, ``1gbit``, ``12.5mbps``)."""
    m = _RATE.match(rate.strip())
    if not m:
        raise ValueError(f"rate {rate!r}: a number and kbit, mbit or gbit (or kbps, mbps or "
                         f"gbps for bytes per second), e.g. 100mbit")
    bits = float(m.group(1)) * _SCALE[m.group(2).lower()]
    bits *= 8 if m.group(3).lower() == "bps" else 1
    if bits <= 0:
        raise ValueError(f"rate {rate!r}: must be above zero")
    return bits


def _run(argv: Sequence[str]) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode:
        raise LinkError(f"`{' '.join(argv)}` failed ({done.returncode}): "
                        f"{(done.stderr or done.stdout).strip()}")
    return done.stdout


def unavailable() -> Optional[str]:
    """Why no cluster can be made here (not root, no ``ip`` or ``tc``), or None."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"no {' or '.join(missing)} tool here (iproute2)"
    return None


_NETEM: Dict[str, Optional[str]] = {}


def netem_unavailable() -> Optional[str]:
    """Why links cannot be given delay or loss here (no netem in this kernel), or None."""
    if "reason" not in _NETEM:
        reason = unavailable()
        if reason is None:
            probe = f"{PREFIX}{os.getpid()}-netem{next(_COUNTER)}"
            _run(["ip", "netns", "add", probe])
            try:
                done = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev",
                                       "lo", "root", "netem", "delay", "1ms"],
                                      capture_output=True, text=True)
                if done.returncode:
                    reason = (f"this kernel has no netem queue (tc: "
                              f"{(done.stderr or done.stdout).strip()})")
            finally:
                subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        _NETEM["reason"] = reason
    return _NETEM["reason"]


def sweep() -> List[str]:
    """Remove the namespaces that clusters of processes no longer running left behind (a
    process killed before it could remove them); the names removed."""
    if unavailable() is not None:
        return []
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    removed = []
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"^{re.escape(PREFIX)}(\d+)-", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _remove(name)
            removed.append(name)
    return removed


def _remove(ns: str) -> None:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(os.path.join(ETC, ns), ignore_errors=True)


def enter(namespace: str) -> None:
    """Move the calling thread (and the threads and sockets it makes afterwards) into the
    network namespace ``namespace`` (``setns``): a worker process calls it first."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise LinkError(f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


class ShapedCluster:
    """``nodes`` network namespaces joined through a switch by links of ``rate`` (tc's
    notation, e.g. ``"100mbit"``; None: unshaped), with ``delay_ms`` of one-way delay and
    ``loss`` percent of packets lost where netem exists (else :class:`LinkError` at
    :meth:`open`). A context manager: made on entry, every namespace removed on exit."""

    def __init__(self, nodes: int = 2, rate: Optional[str] = "100mbit", delay_ms: float = 0.0,
                 loss: float = 0.0) -> None:
        if nodes < 1 or nodes > 250:
            raise ValueError(f"nodes={nodes}: from 1 to 250")
        if rate is not None:
            rate_bits(rate)
        if delay_ms < 0 or not 0 <= loss < 100:
            raise ValueError(f"delay_ms={delay_ms}, loss={loss}: delay at least 0, loss a "
                             f"percentage below 100")
        self.nodes, self.rate, self.delay_ms, self.loss = nodes, rate, delay_ms, loss
        self.name = f"{PREFIX}{os.getpid()}-{next(_COUNTER)}"
        self.switch = f"{self.name}-sw"
        self.namespaces = [f"{self.name}-n{k}" for k in range(nodes)]
        self._made: List[str] = []

    # -- making and removing --------------------------------------------------------------

    def open(self) -> "ShapedCluster":
        """Make the namespaces, links and queues (removing what was made if any step fails)."""
        reason = unavailable()
        if reason is not None:
            raise LinkError(reason)
        if (self.delay_ms or self.loss) and netem_unavailable() is not None:
            raise LinkError(f"delay or loss asked for, and {netem_unavailable()}")
        sweep()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(k)} node{k}\n" for k in range(self.nodes))
        for ns in [self.switch, *self.namespaces]:
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts: names for the nodes
            os.makedirs(os.path.join(ETC, ns), exist_ok=True)
            with open(os.path.join(ETC, ns, "hosts"), "w") as f:
                f.write(hosts)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        tag = next(_COUNTER)
        for k, ns in enumerate(self.namespaces):
            # made in the switch's namespace (names need be unique only there), one end moved
            port, far = f"n{k}", f"x{tag % 1000}-{k}"
            _run(["ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name",
                  far])
            _run(["ip", "-n", self.switch, "link", "set", far, "netns", ns])
            _run(["ip", "-n", ns, "link", "set", far, "name", INTERFACE])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", INTERFACE])
            _run(["ip", "-n", ns, "link", "set", INTERFACE, "up"])
            _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", self.switch, "link", "set", port, "up"])
            self._shape(ns, INTERFACE)
            self._shape(self.switch, port)

    def _shape(self, ns: str, dev: str) -> None:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        parent = ["root"]
        if self.delay_ms or self.loss:
            netem = ["netem"]
            if self.delay_ms:
                netem += ["delay", f"{self.delay_ms}ms"]
            if self.loss:
                netem += ["loss", f"{self.loss}%"]
            _run(tc + ["root", "handle", "1:"] + netem)
            parent = ["parent", "1:1"]
        if self.rate is not None:
            bits = rate_bits(self.rate)
            # a bucket of at least 64 KiB (a whole segmentation-offloaded packet) or 4 ms of
            # the rate; a queue of about 100 ms of the rate
            burst = max(65536, int(bits / 8 * 0.004))
            limit = max(2 * burst, int(bits / 8 * 0.1))
            _run(tc + parent + ["tbf", "rate", f"{int(bits)}bit", "burst", str(burst),
                                "limit", str(limit)])

    def close(self) -> None:
        """Remove every namespace this cluster made (with them its links and queues)."""
        while self._made:
            _remove(self._made.pop())

    def __enter__(self) -> "ShapedCluster":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- using it -------------------------------------------------------------------------

    def address(self, node: int) -> str:
        """The address of ``node`` (on its ``eth0``)."""
        return f"{SUBNET}.{node + 1}"

    def command(self, node: int, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def environment(self, node: int) -> Dict[str, str]:
        """What a ``torch.distributed`` rank on ``node`` needs: gloo on the node's interface,
        the rendezvous at node 0's address."""
        return {"GLOO_SOCKET_IFNAME": INTERFACE, "MASTER_ADDR": self.address(0)}

    def launch(self, per_node: int, argv: Sequence[str], port: int,
               env: Optional[Dict[str, str]] = None) -> List[subprocess.Popen]:
        """``per_node`` processes of ``argv`` on each node, as the ranks of one
        ``torch.distributed`` world (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT``, gloo's interface set): rank ``r`` on node ``r // per_node``."""
        world = self.nodes * per_node
        procs = []
        for rank in range(world):
            node = rank // per_node
            environment = {**os.environ, **(env or {}), **self.environment(node),
                           "RANK": str(rank), "LOCAL_RANK": str(rank % per_node),
                           "WORLD_SIZE": str(world), "MASTER_PORT": str(port)}
            procs.append(subprocess.Popen(self.command(node, argv), env=environment))
        return procs

    def run(self, per_node: int, argv: Sequence[str], port: int, timeout: float,
            env: Optional[Dict[str, str]] = None) -> List[int]:
        """:meth:`launch`, then each rank's exit code; a rank still running after ``timeout``
        seconds raises ``subprocess.TimeoutExpired``, and every rank is killed either way."""
        procs = self.launch(per_node, argv, port, env)
        try:
            return [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                p.kill()

    def cut(self, node: int) -> None:
        """Take ``node``'s link down at the switch: nothing passes to or from it."""
        _run(["ip", "-n", self.switch, "link", "set", f"n{node}", "down"])

    def restore(self, node: int) -> None:
        """Bring ``node``'s link back up."""
        _run(["ip", "-n", self.switch, "link", "set", f"n{node}", "up"])

    def bytes_sent(self, node: int) -> Dict[str, int]:
        """Bytes the shaping queues passed so far: ``"up"``, what ``node`` sent into its link,
        and ``"down"``, what the switch sent to it."""
        return {"up": _sent(self.namespaces[node], INTERFACE),
                "down": _sent(self.switch, f"n{node}")}


def _sent(ns: str, dev: str) -> int:
    out = _run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev])
    m = re.search(r"Sent (\d+) bytes", out)
    return int(m.group(1)) if m else 0

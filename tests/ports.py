"""Loopback ports for the servers tests start (a process group's rank 0, Slurm's daemons).

A port the kernel hands out for port 0 comes from its ephemeral range, the range every outgoing
connection and every gloo listener on the machine draws from too. Rank 0 binds its store seconds
after the port was chosen (a Python start-up later), and with the suite on several pytest-xdist
workers another worker's ranks take ports from that range all the time: one of them could take it
first, rank 0 then fails to listen, and the other ranks wait for it until their timeout. So the
ports come from below the ephemeral range, where nothing is handed out unasked, in a band of their
own for each xdist worker, and each one is checked free when it is chosen.
"""
import itertools
import os
import socket

FIRST = 24000  # above the ports Slurm jobs derive from their job id (20000 + id mod 20000, small ids here)
BAND = 500  # ports per xdist worker


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and the start of IANA's dynamic range is higher still


def _band() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    start = FIRST + BAND * (int(worker) if worker.isdigit() else 0)
    return range(start, start + BAND)


_next = itertools.count()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every address, as a store or a daemon listens
        except OSError:
            return False
    return True


def free_ports(n: int = 1) -> list[int]:
    """`n` distinct ports nothing listens on now, outside the ephemeral range where it lies above
    this worker's band (else, on a machine whose ephemeral range starts lower, the kernel's)."""
    band = _band()
    if band.stop > _ephemeral_start():
        return _kernel_ports(n)
    ports = []
    for _ in range(len(band)):
        port = band[next(_next) % len(band)]
        if _bindable(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise OSError(f"no {n} free ports in {band.start}-{band.stop - 1}: {len(ports)} found")


def free_port() -> int:
    return free_ports(1)[0]


def _kernel_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()

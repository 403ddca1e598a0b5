"""Who is who among the ranks, and how ranks started here are launched.

`mtplxd start --ranks N` makes this process rank 0 and starts N-1 followers on this
machine over MLX's ring backend on loopback: it writes the ring's hostfile (the
format `mlx.launch` writes, one "ip:port" list per rank) into the private state dir
and starts `mtplxd follow` with MLX_RANK and MLX_HOSTFILE set, as mlx.launch would.
Under `mlx.launch` every process already has them (mtplxd/config.py reads them) and
`mtplxd start` becomes rank 0 or a follower by its MLX_RANK.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class World:
    rank: int
    backend: str  # mx.distributed backend: "ring" here, "any" under mlx.launch
    environment: tuple[tuple[str, str], ...] = ()  # what mx.distributed.init reads (mlx.launch set it already)


def init_group(world: World) -> Any:
    """Join the other ranks (blocks until every rank is there)."""
    import mlx.core as mx

    from mtplxd.config import export_environment

    export_environment(dict(world.environment))
    return mx.distributed.init(strict=True, backend=world.backend)


def rank_folder(rank: int, size: int) -> str:
    """Each rank's own slice of every session snapshot lives apart, tagged so that a
    restore at another world size finds nothing rather than a wrong cache."""
    return f"rank{rank}-of{size}"


# -- ranks started here --------------------------------------------------------------------


def local_world(size: int, folder: Path) -> tuple[World, Path]:
    """Rank 0 of `size` ranks on loopback; the hostfile the followers read."""
    ports = _free_ports(size)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    hostfile = folder / "ring-hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
    hostfile.chmod(0o600)
    environment = (("MLX_RANK", "0"), ("MLX_HOSTFILE", str(hostfile)))
    return World(0, "ring", environment), hostfile


def start_followers(size: int, hostfile: Path, state_dir: Path, log_folder: Path) -> list[subprocess.Popen]:
    """Ranks 1..size-1 as `mtplxd follow` processes of this one (their output in the
    state dir's logs)."""
    from mtplxd.config import rank_environment

    followers = []
    for rank in range(1, size):
        env = rank_environment(rank, hostfile)
        log = open(log_folder / f"rank{rank}.log", "ab")
        followers.append(subprocess.Popen(
            [sys.executable, "-m", "mtplxd", "follow", "--state-dir", str(state_dir)],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        ))
        log.close()
    return followers


def stop_followers(followers: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Ask, then make: no follower outlives rank 0."""
    for process in followers:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in followers:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()

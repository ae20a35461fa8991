"""The soak's processes: its own servers (MinIO, Redis with AOF, Apache Kafka) and the daemons
(trackers, reapers) as separate OS processes, so that kill -9 is real.

The soak always starts its own servers (it kills and restarts them); a broker restart keeps its
log, and a broker whose log is lost is killed, its data directory wiped and formatted with a new
cluster id, and started on the same port. Daemons reach S3 through a :class:`FaultProxy`.
A :class:`Supervisor` restarts any daemon that exits, as systemd or Kubernetes would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from core.clients import redis_sync
from core.logs import get_logger
from core.settings import ENV_PREFIX, Settings
from sim.faultproxy import FaultProxy
from sim.stack import (
    KafkaServer,
    Server,
    kafka_server,
    minio_server,
    redis_server,
    tmpfs_root,
)

log = get_logger(__name__)


def settings_env(settings: Settings) -> dict[str, str]:
    """Every setting as a ``HARDELETE_*`` variable: a daemon process sees exactly these."""
    env: dict[str, str] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        env[ENV_PREFIX + f.name.upper()] = (str(value).lower() if isinstance(value, bool)
                                            else str(value))
    return env



PYTHON_CLI = (sys.executable, "-m", "hardelete.cli")  # how the soak starts a daemon

@dataclass
class SoakServers:
    """MinIO, Redis (AOF, fsync always) and Apache Kafka (KRaft, one node); Kafka's and MinIO's
    data on tmpfs where the machine has one."""

    workdir: Path
    settings: Settings  # points at the servers; the model service and the checks use it
    minio: Server
    redis: Server
    broker: KafkaServer
    proxy: FaultProxy
    data_dir: Path
    log_generation: int = 0
    redis_snapshots: list[Path] = field(default_factory=list)
    # Fault steps run in threads: two Redis faults at once (a restart 0.25 s after another)
    # left the handle on a dead process, and every later restart or rollback did nothing
    # while counted as injected (found by a review helper). One at a time, per server.
    _redis_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _broker_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def daemon_settings(self) -> Settings:
        """What trackers, reapers and reconciler runs see: S3 through the fault proxy."""
        return self.settings.replace(s3_endpoint_url=self.proxy.url)

    # -- Redis --

    @property
    def redis_dir(self) -> Path:
        return self.workdir / f"redis-{self.redis.port}"

    def kill_redis(self, down_seconds: float = 0.0) -> None:
        with self._redis_lock:
            self.redis.kill()
            time.sleep(down_seconds)
            self.redis.start(move_on_clash=False)

    def snapshot_redis(self) -> Path:
        """A copy of Redis' AOF as it is now (fsync always: a torn last command is truncated
        on load, which is what a real crash leaves too)."""
        with self._redis_lock:
            dest = self.workdir / f"redis-snapshot-{len(self.redis_snapshots)}"
            shutil.copytree(self.redis_dir / "appendonlydir", dest)
            self.redis_snapshots.append(dest)
            return dest

    def rollback_redis(self, snapshot: Path) -> None:
        """Restart Redis from an older copy of its data (a restored backup, a lagging
        replica promoted)."""
        with self._redis_lock:
            self.redis.kill()
            shutil.rmtree(self.redis_dir / "appendonlydir", ignore_errors=True)
            shutil.copytree(snapshot, self.redis_dir / "appendonlydir")
            self.redis.start(move_on_clash=False)

    # -- broker --

    def restart_broker(self, *, lose_log: bool, down_seconds: float = 0.0,
                       hard: bool = False) -> None:
        """Restart the broker: stopped (``hard``: kill -9), down a moment, started again on
        the same log, or on an empty one formatted with a new cluster id (``lose_log``)."""
        with self._broker_lock:
            if hard:
                self.broker.kill()
            else:
                self.broker.stop()
            time.sleep(down_seconds)
            if lose_log:
                self.log_generation += 1
                self.broker.lose_log()
            self.broker.start(move_on_clash=False)

    def stop(self, keep: bool = False) -> None:
        """Stop every server; ``keep``: move their data (on tmpfs) into the work directory, so
        a kept run's reports, manifests and log can be read afterwards."""
        with contextlib.suppress(Exception):
            self.proxy.__exit__(None, None, None)
        for server in (self.broker, self.redis, self.minio):
            server.stop()
        if keep and self.data_dir.parent != self.workdir:
            shutil.move(self.data_dir, self.workdir / "data")
        else:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def start_servers(base: Settings, workdir: Path) -> SoakServers:
    started: list[Server] = []
    data = Path(tempfile.mkdtemp(prefix="hardelete-soak-data-", dir=tmpfs_root() or workdir))
    try:
        minio = minio_server(workdir, data_dir=data / "minio", access_key=base.s3_access_key,
                             secret_key=base.s3_secret_key)
        minio.start()
        started.append(minio)
        s3_url = f"http://127.0.0.1:{minio.port}"
        redis = redis_server(workdir, aof=True)
        redis.start()
        started.append(redis)
        broker = kafka_server(workdir, data_dir=data / "kafka")
        broker.start()
        started.append(broker)
        proxy = FaultProxy(s3_url, access_key=base.s3_access_key,
                           secret_key=base.s3_secret_key, region=base.s3_region).__enter__()
    except BaseException:
        for server in reversed(started):
            server.stop()
        shutil.rmtree(data, ignore_errors=True)
        raise
    settings = base.replace(s3_endpoint_url=s3_url,
                            kafka_bootstrap=f"127.0.0.1:{broker.port}",
                            redis_url=f"redis://127.0.0.1:{redis.port}/0")
    return SoakServers(workdir, settings, minio, redis, broker, proxy, data)


@dataclass
class Daemon:
    """One daemon process (``hardelete tracker run`` / ``reaper run``) with its own log."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0
    exits: list[int] = field(default_factory=list)  # return codes of unplanned exits

    def start(self) -> None:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env},
                                         start_new_session=True)
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.kills += 1

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Supervisor:
    """Restarts daemons that exited on their own; the soak kills and restarts them too."""

    daemons: dict[str, Daemon]

    def start_all(self) -> None:
        for d in self.daemons.values():
            d.start()

    def check(self) -> list[str]:
        """Restart every daemon that is not running; return their names."""
        restarted = []
        for d in self.daemons.values():
            if d.proc is not None and d.proc.poll() is not None:
                d.exits.append(d.proc.returncode)
                log.warning("soak.daemon_exited", daemon=d.name, code=d.proc.returncode,
                            tail=d.tail(5))
                d.start()
                restarted.append(d.name)
        return restarted

    def kill_and_restart(self, name: str) -> None:
        d = self.daemons[name]
        d.kill9()
        d.start()

    def stop_all(self) -> None:
        for d in self.daemons.values():
            d.stop()


def make_daemons(settings: Settings, workdir: Path, *, trackers: int, reapers: int,
                 command: tuple[str, ...], reaper_command: tuple[str, ...]) -> Supervisor:
    env = settings_env(settings)
    env["HARDELETE_LOG_FORMAT"] = "json"
    daemons: dict[str, Daemon] = {}
    for i in range(trackers):
        name = f"tracker-{i}"
        daemons[name] = Daemon(name, [*command, "tracker", "run", "--name", name], env,
                               workdir / f"{name}.log")
    for i in range(reapers):
        name = f"reaper-{i}"
        daemons[name] = Daemon(name, [*reaper_command, "reaper", "run"], env,
                               workdir / f"{name}.log")
    return Supervisor(daemons)


def redis_up(settings: Settings) -> bool:
    try:
        r = redis_sync(settings)
        try:
            return bool(r.ping())
        finally:
            r.close()
    except Exception:
        return False

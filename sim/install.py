"""The embedded stack's servers, installed on first use: Apache Kafka and MinIO (and
Prometheus for the alert tests).

Both go into a cache outside the source tree, keyed by version and shared by every clone
(``$HARDELETE_CACHE``, else ``$XDG_CACHE_HOME/hardelete``, else ``~/.cache/hardelete``):

- Apache Kafka :data:`KAFKA_VERSION`: Maven resolves the jars the pinned ``kafka-pom.xml`` names
  (about 45 jars, 43 MB; ~10-20 s) into ``kafka-<version>-<pom hash>/libs/``. Needs Java 17+
  and Maven.
- MinIO :data:`MINIO_VERSION`: ``go install`` of its Go module (MinIO publishes its community
  edition as source only): a 150 MB binary at ``minio-<version>/minio``, 3.5-7 minutes on two
  cores. Needs Go (a newer toolchain is fetched by Go itself when the module asks for one).

Prometheus (``prometheus`` and ``promtool``, for the alert rules' tests) is Debian's package,
installed with ``apt-get`` (as root) only when either is missing from PATH: 8-14 s measured.
Its service is not started: the tests run the binary with their own configuration.

An install is built in a private directory and renamed into place, under a file lock: parallel
processes (pytest workers) install once, the others wait for it. Progress goes to stderr.
``python -m sim.install`` installs Kafka and MinIO (``./dev`` runs it before the tests and the
demo); ``--prometheus``, Prometheus too (``./dev test``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

KAFKA_VERSION = "4.4.0"
MINIO_MODULE = "github.com/minio/minio"
MINIO_VERSION = "v0.0.0-20260212201848-7aac2a2c5b7c"
PROMETHEUS_PACKAGE = "prometheus"  # Debian's: both binaries, 2.42 on bookworm
# Pinned: the plugin Maven would otherwise pick depends on the Maven version installed.
_MAVEN_DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
_JAVA_MIN = 17  # Kafka 4 brokers need Java 17


class InstallError(RuntimeError):
    """A server cannot be installed; the message says what is missing and what to do."""


def cache_dir() -> Path:
    if os.environ.get("HARDELETE_CACHE"):
        return Path(os.environ["HARDELETE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hardelete"


def _say(msg: str) -> None:
    print(f"hardelete: {msg}", file=sys.stderr, flush=True)


def _pom() -> bytes:
    return resources.files("sim").joinpath("kafka-pom.xml").read_bytes()


def kafka_dir() -> Path:
    """Where this version of the pom installs (the pom's hash: a changed pom installs anew)."""
    digest = hashlib.sha256(_pom()).hexdigest()[:8]
    return cache_dir() / f"kafka-{KAFKA_VERSION}-{digest}"


def minio_path() -> Path:
    return cache_dir() / f"minio-{MINIO_VERSION}" / "minio"


def java_binary() -> str:
    """``java``, checked to be 17 or newer."""
    java = shutil.which("java")
    if not java:
        raise InstallError(
            f"the embedded Kafka needs Java {_JAVA_MIN} or newer, and no `java` is on PATH: "
            "install one (Debian/Ubuntu: apt-get install openjdk-17-jre-headless), or point "
            "HARDELETE_KAFKA_BOOTSTRAP at a running Kafka")
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    major = int(m.group(1)) if m else 0
    if major == 1 and m and m.group(2):  # "1.8.0": Java 8
        major = int(m.group(2))
    if major < _JAVA_MIN:
        raise InstallError(
            f"the embedded Kafka needs Java {_JAVA_MIN} or newer; {java} is "
            f"{out.splitlines()[0] if out else 'unknown'}: install a newer one "
            "(apt-get install openjdk-17-jre-headless), or set HARDELETE_KAFKA_BOOTSTRAP")
    return java


def _need(tool: str, what: str, hint: str) -> str:
    found = shutil.which(tool)
    if not found:
        raise InstallError(f"{what} needs `{tool}`, which is not on PATH: {hint}")
    return found


@contextlib.contextmanager
def _locked(path: Path, what: str) -> Iterator[None]:
    """An exclusive lock on ``path``; says so when another process holds it."""
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process installing {what}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _heartbeat(what: str, every: float = 30.0) -> Iterator[None]:
    """A progress line every ``every`` seconds while a long step runs."""
    done = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not done.wait(every):
            _say(f"still {what} ({time.monotonic() - t0:.0f} s)")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _install(final: Path, what: str, expect: str, build: Callable[[Path], None]) -> Path:
    """Build into a private directory beside ``final``, then rename it into place."""
    if final.exists():
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{final.name}.lock", what):
        if final.exists():  # another process installed it meanwhile
            return final
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        t0 = time.monotonic()
        _say(f"installing {what} into {final} (first use only; {expect})")
        try:
            build(staging)
            staging.chmod(0o755)  # (mkdtemp's 0700: other users of the cache read it too)
            os.rename(staging, final)  # atomic: the directory is complete or absent
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _say(f"installed {what} in {time.monotonic() - t0:.0f} s")
    return final


def _run(argv: list[str], what: str, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise InstallError(f"{what} failed (exit {proc.returncode}): {' '.join(argv)}\n{tail}")


def install_kafka() -> Path:
    """The directory holding ``libs/`` (the broker's classpath); installed if absent."""
    final = kafka_dir()
    if final.exists():
        return final
    java_binary()
    mvn = _need("mvn", f"installing Apache Kafka {KAFKA_VERSION}",
                "install Maven (apt-get install maven), or set HARDELETE_KAFKA_BOOTSTRAP")

    def build(staging: Path) -> None:
        (staging / "pom.xml").write_bytes(_pom())
        with _heartbeat(f"resolving Apache Kafka {KAFKA_VERSION} with Maven"):
            _run([mvn, "-q", "-B", "-f", str(staging / "pom.xml"),
                  f"-Dmaven.repo.local={cache_dir() / 'm2'}",
                  f"{_MAVEN_DEPENDENCY_PLUGIN}:copy-dependencies",
                  f"-DoutputDirectory={staging / 'libs'}"],
                 f"resolving Apache Kafka {KAFKA_VERSION}")
        if not (staging / "libs" / f"kafka_2.13-{KAFKA_VERSION}.jar").exists():
            raise InstallError(f"Maven finished but kafka_2.13-{KAFKA_VERSION}.jar is missing "
                               f"from {staging / 'libs'}")

    return _install(final, f"Apache Kafka {KAFKA_VERSION}", "about 15 s", build)


def kafka_classpath() -> str:
    return str(install_kafka() / "libs" / "*")


def install_minio() -> Path:
    """The MinIO server binary; built from its Go module if absent."""
    final = minio_path().parent
    if final.exists():
        return minio_path()
    go = _need("go", f"building MinIO {MINIO_VERSION}",
               "install Go (https://go.dev/dl/), or point HARDELETE_S3_ENDPOINT_URL at an S3 "
               "server")

    def build(staging: Path) -> None:
        # Go's module and build caches (about 2 GB) live in the staging directory and go with
        # it: only the binary is kept.
        gopath = staging / ".go"
        env = {
            "GOPATH": str(gopath),
            "GOCACHE": str(gopath / "build-cache"),
            "GOBIN": str(staging),
            "GOFLAGS": "-modcacherw -buildvcs=false",  # (read-write: the cache can be removed)
            "CGO_ENABLED": "0",
        }
        try:
            with _heartbeat("building MinIO (go install; minutes on a small machine)", 60):
                _run([go, "install", f"{MINIO_MODULE}@{MINIO_VERSION}"], "building MinIO",
                     env=env)
        finally:
            shutil.rmtree(gopath, ignore_errors=True)
        if not (staging / "minio").exists():
            raise InstallError(f"go install finished but no minio binary in {staging}")

    _install(final, f"MinIO {MINIO_VERSION}", "3.5-7 minutes on two cores", build)
    return minio_path()


def prometheus_binaries() -> tuple[str, str]:
    """``(prometheus, promtool)``; Debian's ``prometheus`` package is installed if either is
    missing (root, apt-get)."""
    found = _prometheus_on_path()
    if found is not None:
        return found
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        raise InstallError(
            "the alert tests need Prometheus' `prometheus` and `promtool` (2.42 or newer), "
            "which are not on PATH: install them (Debian/Ubuntu, as root: apt-get install "
            "--no-install-recommends prometheus)")
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".prometheus.lock", "Prometheus"):
        found = _prometheus_on_path()  # another process installed it meanwhile
        if found is not None:
            return found
        t0 = time.monotonic()
        _say(f"installing Debian's {PROMETHEUS_PACKAGE} package with apt-get (first use only; "
             "about 10 s)")
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        # Waits for another apt-get instead of failing on its lock.
        install = [apt, "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-q",
                   "--no-install-recommends", PROMETHEUS_PACKAGE]
        with _heartbeat(f"installing {PROMETHEUS_PACKAGE} with apt-get"):
            try:
                _run(install, f"apt-get install {PROMETHEUS_PACKAGE}", env=env)
            except InstallError:
                # A fresh machine's package lists may be empty or stale: once, then again.
                _run([apt, "-o", "DPkg::Lock::Timeout=600", "update", "-q"],
                     "apt-get update", env=env)
                _run(install, f"apt-get install {PROMETHEUS_PACKAGE}", env=env)
        if Path("/run/systemd/system").exists():
            # The package starts its service where systemd runs: the tests start their own.
            subprocess.run(["systemctl", "disable", "--now", "prometheus.service"],
                           capture_output=True)
        found = _prometheus_on_path()
        if found is None:
            raise InstallError(f"apt-get installed {PROMETHEUS_PACKAGE} but `prometheus` or "
                               "`promtool` is still not on PATH")
        _say(f"installed {PROMETHEUS_PACKAGE} in {time.monotonic() - t0:.0f} s")
        return found


def _prometheus_on_path() -> tuple[str, str] | None:
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    return (prometheus, promtool) if prometheus and promtool else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sim.install",
        description="Install the embedded stack's Apache Kafka and MinIO into the cache (and "
                    "Debian's prometheus package where prometheus or promtool is missing).")
    parser.add_argument("--check", action="store_true",
                        help="only say what is installed; exit 1 if something is missing")
    parser.add_argument("--prometheus", action="store_true",
                        help="Prometheus too (the tests need it; the demo does not)")
    args = parser.parse_args(argv)
    if args.check:
        missing = 0
        for what, path in ((f"Apache Kafka {KAFKA_VERSION}", kafka_dir()),
                           (f"MinIO {MINIO_VERSION}", minio_path())):
            print(f"{what}: {path if path.exists() else 'not installed'}")
            missing += not path.exists()
        if args.prometheus:
            prom = _prometheus_on_path()
            print(f"Prometheus: {' and '.join(prom) if prom else 'not installed'}")
            missing += prom is None
        return 1 if missing else 0
    try:
        install_kafka()
        install_minio()
        if args.prometheus:
            prometheus_binaries()
    except InstallError as exc:
        _say(str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A valkey-server whose wall clock a test shifts while it runs (an ``LD_PRELOAD`` shim over
``gettimeofday``, ``clock_gettime(CLOCK_REALTIME*)`` and ``time``): what a node's clock does when
NTP steps it, or what a repository's slot sees when it fails over to a replica whose clock
differs. ``TIME`` is the only clock the continuity proof reads. The fixtures that start them
are in ``tests/integration/tracker/conftest.py``."""

from __future__ import annotations

import mmap
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sim.stack import Server, redis_server

# A wall-clock shift for one server: gettimeofday, clock_gettime(CLOCK_REALTIME*) and time()
# add the microseconds held in the file named by CLOCK_SHIFT_FILE (read through a shared
# mapping on every call, so the test moves the clock while the server runs).
_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
static volatile int64_t *shift_us;
static int (*real_cg)(clockid_t, struct timespec *);
static int (*real_gtod)(struct timeval *, void *);
static int64_t offset(void) {
  if (!shift_us) {
    const char *path = getenv("CLOCK_SHIFT_FILE");
    int fd = path ? open(path, O_RDONLY) : -1;
    if (fd < 0) return 0;
    void *p = mmap(NULL, 8, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return 0;
    shift_us = (volatile int64_t *)p;
  }
  return *shift_us;
}
int clock_gettime(clockid_t id, struct timespec *ts) {
  if (!real_cg) real_cg = dlsym(RTLD_NEXT, "clock_gettime");
  int rc = real_cg(id, ts);
  if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
    int64_t ns = (int64_t)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset() * 1000LL;
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
  }
  return rc;
}
int gettimeofday(struct timeval *tv, void *tz) {
  if (!real_gtod) real_gtod = dlsym(RTLD_NEXT, "gettimeofday");
  int rc = real_gtod(tv, tz);
  if (rc == 0 && tv) {
    int64_t us = (int64_t)tv->tv_sec * 1000000LL + tv->tv_usec + offset();
    tv->tv_sec = us / 1000000LL;
    tv->tv_usec = us % 1000000LL;
  }
  return rc;
}
time_t time(time_t *t) {
  struct timeval tv;
  gettimeofday(&tv, NULL);
  if (t) *t = tv.tv_sec;
  return tv.tv_sec;
}
"""


@dataclass
class ShiftedRedis:
    server: Server
    shift_file: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.server.port}/0"

    def shift(self, seconds: float) -> None:
        """The server's wall clock is ``seconds`` off the machine's from now on."""
        with self.shift_file.open("r+b") as f, mmap.mmap(f.fileno(), 8) as m:
            m[:8] = struct.pack("<q", int(seconds * 1_000_000))


def compile_shim(wd: Path) -> Path | None:
    """The clock shim compiled in ``wd`` (its ``.so``), or None without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    (wd / "shift.c").write_text(_SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(wd / "shift.so"),
                    str(wd / "shift.c"), "-ldl"], check=True)
    return wd / "shift.so"


def shifted_server(shim: Path, wd: Path, *, cluster: bool = False) -> ShiftedRedis:
    """A valkey-server (not started) whose wall clock the test shifts."""
    shift_file = wd / f"shift-{time.monotonic_ns()}"
    shift_file.write_bytes(struct.pack("<q", 0))
    server = redis_server(wd, cluster=cluster, malloc="libc")
    server.env = {"LD_PRELOAD": str(shim), "CLOCK_SHIFT_FILE": str(shift_file)}
    return ShiftedRedis(server, shift_file)


@dataclass
class FailoverPair:
    """A primary and its replica (:func:`failover_pair`), each with its own clock."""

    primary: ShiftedRedis
    replica: ShiftedRedis

    @property
    def url(self) -> str:
        return self.primary.url

    def failover(self) -> None:
        """A manual (graceful) failover: the replica catches up with the primary first, so
        nothing is lost (the planned maintenance of a node)."""
        import redis as redis_lib

        r = redis_lib.Redis(port=self.replica.server.port)
        try:
            r.execute_command("CLUSTER", "FAILOVER")  # type: ignore[no-untyped-call]
            deadline = time.monotonic() + 30
            while r.info("replication").get("role") != "master":
                assert time.monotonic() < deadline, "the failover did not complete"
                time.sleep(0.02)
        finally:
            r.close()


@contextmanager
def failover_pair(shim: Path, wd: Path) -> Iterator[FailoverPair]:
    """A Redis Cluster of one primary (every slot) and its replica, each with its own clock."""
    import redis as redis_lib

    from sim.stack import _form_cluster

    primary, replica = shifted_server(shim, wd, cluster=True), \
        shifted_server(shim, wd, cluster=True)
    primary.server.start()
    try:
        replica.server.start()
        try:
            _form_cluster([primary.server])
            p = redis_lib.Redis(port=primary.server.port)
            q = redis_lib.Redis(port=replica.server.port)
            bus = primary.server.argv[primary.server.argv.index("--cluster-port") + 1]
            q.execute_command(  # type: ignore[no-untyped-call]
                "CLUSTER", "MEET", "127.0.0.1", primary.server.port, bus)
            pid = p.execute_command("CLUSTER", "MYID")  # type: ignore[no-untyped-call]
            pid = pid.decode() if isinstance(pid, bytes) else pid
            deadline = time.monotonic() + 30
            while True:
                try:
                    q.execute_command(  # type: ignore[no-untyped-call]
                        "CLUSTER", "REPLICATE", pid)
                    break
                except redis_lib.ResponseError:  # (the replica does not know it yet)
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            while q.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline, "the replica did not sync"
                time.sleep(0.05)
            p.close()
            q.close()
            yield FailoverPair(primary, replica)
        finally:
            replica.server.stop()
    finally:
        primary.server.stop()



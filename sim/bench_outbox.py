"""The model service's write rate with an outbox, per repository and with K stripes.

    ./dev bench outbox --ops 5000 --relay   # = .venv/bin/python -m sim.bench_outbox

Runs the same seeded workload (``sim.model.Workload``, the default mix, over ``--repos``
repositories) through the model service's pure model (``sim.model.Model``): in memory (no
store), with one SQLite transaction of its own per operation (the bar: a service whose store is
SQLite commits each change anyway), with an outbox on SQLite and one ordering domain per
repository, with ``--stripes`` stripes per repository, and with the outbox without fsync (its
CPU cost alone). Each operation is one outbox
transaction (``synchronous=FULL``: a commit is on the disk when it returns; a lost commit would
take the store back without a new incarnation). Then ``--threads`` writer threads commit
one-event transactions into one repository, with 1 and with K stripes: what the counters cost
when writers run concurrently. With ``--relay`` it also starts the embedded Kafka and measures
the relay publishing the striped run's rows and answering a tick. The database lives in
``--dir`` (default: a new temporary directory; put it on the disk the service would use).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sqlite3
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas import events as ev
from schemas.outbox import Outbox
from sim.model import ManualClock, Model, OpEvents, Workload, run_workload, seeded_ids


@dataclass
class Run:
    label: str
    ops: int
    events: int
    seconds: float

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds


class PlainStoreModel(Model):
    """The bar for the outbox: each operation's events written in one SQLite transaction of
    the service's own (same bytes, same commits), without counters."""

    def __init__(self, path: Path, **kw: Any) -> None:
        super().__init__(**kw)
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE IF NOT EXISTS changes (id INTEGER PRIMARY KEY, "
                        "repository TEXT, value BLOB)")

    def _emit(self, events: list[ev.Event], **products: Any) -> OpEvents:
        if events:
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany("INSERT INTO changes (repository, value) VALUES (?, ?)",
                                [(e.repository, ev.encode(e)) for e in events])
            self.db.execute("COMMIT")
        return super()._emit(events, **products)


def model_run(label: str, ops: int, repos: int, seed: int, outbox: Outbox | None,
              stripes: int, plain: Path | None = None) -> Run:
    kw: dict[str, Any] = {"clock": ManualClock(1_700_000_000.0, 0.01),
                          "new_id": seeded_ids(seed)}
    model = PlainStoreModel(plain, **kw) if plain else Model(outbox=outbox, **kw)
    wl = Workload(seed, ops, repos=repos)
    for repo in wl.repo_ids():
        model.create_repository(repo, wl.namespace(repo), stripes=stripes)
    before = len(model.events)
    t0 = time.perf_counter()
    run_workload(model, wl)
    seconds = time.perf_counter() - t0
    return Run(label, ops + wl.setup_ops - repos, len(model.events) - before, seconds)


def threads_run(label: str, path: Path, threads: int, per_thread: int, stripes: int) -> Run:
    with Outbox(path) as box, box.transaction() as tx:
        tx.emit(ev.RepositoryCreated(repository="hot", storage_namespace="s3://b/hot/",
                                     default_branch="main", default_retention_days=7,
                                     stripes=stripes))
    barrier = threading.Barrier(threads + 1)

    def writer(i: int) -> None:
        with Outbox(path) as box:
            barrier.wait()
            for n in range(per_thread):
                with box.transaction() as tx:
                    tx.emit(ev.TagCreated(repository="hot", tag=f"t{i}-{n}", commit_id="c",
                                          ref_version=1), stripe=(i + n) % stripes)

    workers = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t0
    n = threads * per_thread
    return Run(label, n, n, seconds)


async def relay_run(path: Path) -> tuple[float, int, float]:
    """(rows/s the relay publishes from the backlog, rows, seconds from a tick to its last
    watermark on the log)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from core.settings import load_settings
    from schemas import control
    from schemas.relay import Relay
    from sim.stack import embedded_stack

    with embedded_stack(load_settings(env={}, log_level="warning"), redis=False,
                        s3=False) as stack:
        s = stack.settings
        with Outbox(path) as outbox:
            rows = len(outbox.unpublished(limit=10**9))
            relay = Relay(s, outbox, batch=5000)
            t0 = time.perf_counter()
            await relay.start()
            await relay.publish_pending()  # (the loop's own pass may hold the flush: waits)
            publish_s = time.perf_counter() - t0
            assert not outbox.unpublished(limit=1)
            consumer = AIOKafkaConsumer(s.events_topic, bootstrap_servers=s.kafka_bootstrap,
                                        auto_offset_reset="latest", group_id=None)
            await consumer.start()
            await consumer.seek_to_end()
            producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap)
            await producer.start()
            target = "wl-r0"
            counters = outbox.counters(target)
            assert counters is not None
            tick = control.signed_tick(b"bench", target, 1, tick_id="bench")
            t1 = time.perf_counter()
            await producer.send_and_wait(s.control_topic, control.encode(tick), key=tick.key)
            seen = 0
            while seen < counters.stripes:
                for records in (await consumer.getmany(timeout_ms=100)).values():
                    seen += sum(1 for r in records if b'"watermark"' in (r.value or b""))
            tick_s = time.perf_counter() - t1
            await producer.stop()
            await consumer.stop()
            await relay.stop()
    return rows / publish_s, rows, tick_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.bench_outbox", description=__doc__)
    ap.add_argument("--ops", type=int, default=5_000)
    ap.add_argument("--repos", type=int, default=4)
    ap.add_argument("--stripes", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--per-thread", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default="", help="where the databases go (default: a new "
                                              "temporary directory, removed afterwards)")
    ap.add_argument("--relay", action="store_true", help="also measure the relay (Kafka)")
    args = ap.parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-outbox-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        return _bench(args, base)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


def _bench(args: argparse.Namespace, base: Path) -> int:
    runs = [model_run("model in memory, no store", args.ops, args.repos, args.seed, None, 1),
            model_run("model + its own SQLite commit per op", args.ops, args.repos,
                      args.seed, None, 1, plain=base / "plain.db")]
    with Outbox(base / "k1.db") as box:
        runs.append(model_run("model + outbox, 1 domain per repository", args.ops, args.repos,
                              args.seed, box, 1))
    with Outbox(base / "kk.db") as box:
        runs.append(model_run(f"model + outbox, {args.stripes} stripes per repository",
                              args.ops, args.repos, args.seed, box, args.stripes))
    with Outbox(base / "off.db", synchronous="OFF") as box:
        runs.append(model_run("model + outbox, 1 domain, no fsync (CPU only)", args.ops,
                              args.repos, args.seed, box, 1))
    runs.append(threads_run(f"{args.threads} writer threads, 1 repository, 1 domain",
                            base / "t1.db", args.threads, args.per_thread, 1))
    runs.append(threads_run(f"{args.threads} writer threads, 1 repository, "
                            f"{args.stripes} stripes", base / "tk.db", args.threads,
                            args.per_thread, args.stripes))
    print(f"databases in {base.resolve()}")
    for r in runs:
        print(f"{r.label:<48} {r.ops:>8,} ops  {r.ops_per_s:>10,.0f} ops/s  "
              f"{r.events_per_s:>10,.0f} events/s")
    print(f"outbox / own commit: 1 domain {runs[2].ops_per_s / runs[1].ops_per_s:.2f}, "
          f"{args.stripes} stripes {runs[3].ops_per_s / runs[1].ops_per_s:.2f}; "
          f"without fsync / in memory {runs[4].ops_per_s / runs[0].ops_per_s:.2f}")
    if args.relay:
        rate, rows, tick_s = asyncio.run(relay_run(base / "kk.db"))
        print(f"relay: published {rows:,} rows at {rate:,.0f} rows/s; a tick answered "
              f"(all {args.stripes} watermarks on the log) in {tick_s * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

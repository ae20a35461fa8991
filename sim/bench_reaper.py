"""Reaper throughput against a raw boto3 ``delete_objects`` loop on the same S3 server, in one
run; and the unreferenced-to-deleted latency with a live tracker.

    .venv/bin/python -m sim.bench_reaper --objects 20000

Phase 1 (throughput): 2N objects are PUT into the embedded S3 server (MinIO). N are deleted by a raw
sequential ``delete_objects`` loop (1,000 keys per request, one client): the physical limit.
The two alternate in rounds (raw, reaper, raw, reaper, ...) because the server's speed drifts
during a run. For the other N, the tracker's own apply script records a write and a delete (so
they are unreferenced, exactly as the tracker would leave them), the tracker-progress record is
set to the Redis clock (the benchmark stands in for a caught-up tracker), and the reaper deletes
them with its real path: claim script, bulk parallel deletes, completion script.

Phase 2 (latency): Kafka + tracker + reaper live, grace 1 s; the model service writes and then
deletes M objects; each confirmed delete's time since its address became unreferenced (tracker
clock) is recorded. Reported as percentiles, and as time beyond the grace window.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from core.clients import redis_sync, s3_client
from core.clock import redis_time_ms
from core.logs import configure_logging
from core.settings import Settings, load_settings
from reaper.daemon import Reaper
from schemas import events as ev
from schemas.layout import PROGRESS, PROGRESS_META, REPOS
from schemas.publisher import Publisher, ensure_topics
from sim.model import Model, ModelService
from sim.stack import embedded_stack
from sim.testing import apply_lua, lua_batches
from tracker import codec
from tracker.daemon import Tracker


def _put_all(s3: Any, bucket: str, keys: list[str], progress: Progress) -> None:
    task = progress.add_task("PUT objects into S3", total=len(keys))

    def put(k: str) -> None:
        s3.put_object(Bucket=bucket, Key=k, Body=b"x")

    with ThreadPoolExecutor(16) as pool:
        for _ in pool.map(put, keys):
            progress.advance(task)


def _raw_delete(s3: Any, bucket: str, keys: list[str]) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(keys), 1000):
        resp = s3.delete_objects(Bucket=bucket, Delete={
            "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
        assert not resp.get("Errors"), resp.get("Errors")
    return time.perf_counter() - t0


def _obstore_delete(settings: Settings, bucket: str, keys: list[str]) -> float:
    """The faster limit: the same bulk deletes by obstore (Rust object_store), one caller."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=settings.s3_endpoint_url, region=settings.s3_region,
                    access_key_id=settings.s3_access_key,
                    secret_access_key=settings.s3_secret_key,
                    client_options={"allow_http": True})
    t0 = time.perf_counter()
    for i in range(0, len(keys), 1000):
        obstore.delete(store, keys[i:i + 1000])
    return time.perf_counter() - t0


def _track_as_garbage(settings: Settings, repo: str, namespace: str,
                      addresses: list[str]) -> None:
    """Record write + delete of each address through the tracker's apply script."""
    events: list[ev.Event] = [ev.RepositoryCreated(
        repository=repo, storage_namespace=namespace, default_branch="main",
        default_retention_days=7.0), ev.BranchCreated(repository=repo, branch="main",
                                                      staging_token="t0", ref_version=1)]
    for a in addresses:
        ref = uuid.uuid4().hex
        events.append(ev.ObjectWritten(repository=repo, branch="main", staging_token="t0",
                                       path=a, address=a, size=1, ref_id=ref))
        events.append(ev.ObjectDeleted(repository=repo, branch="main", staging_token="t0",
                                       path=a, address=a, ref_id=ref))
    r = redis_sync(settings)
    try:
        gate = codec.Gate()
        for i in range(0, len(events), 5000):
            batch, rejected = lua_batches(events[i:i + 5000], gate, first_offset=i)
            assert not rejected, rejected[:3]
            apply_lua(r, batch, None)
        # The daemon registers repositories and progress outside the per-repository script:
        # stand in for a caught-up tracker on a one-partition topic.
        r.sadd(REPOS, repo)
        r.hset(PROGRESS_META, mapping={"partitions": 1, "topic": "bench"})
        r.hset(PROGRESS, "0", redis_time_ms(r))
    finally:
        r.close()


async def _reap_all(settings: Settings, n: int) -> float:
    await ensure_topics(settings)  # the reaper publishes its records of confirmed deletes
    reaper = Reaper(settings, reaper_id="bench")
    deleted = 0
    t0 = time.perf_counter()
    try:
        while deleted < n:
            report = await reaper.run_once()
            got = report.total("deleted")
            if not got:
                raise RuntimeError(f"the reaper stopped at {deleted} of {n}: {report.as_dict()}")
            deleted += got
    finally:
        await reaper.close()
    return time.perf_counter() - t0


async def _latency(settings: Settings, m: int, rate: float, progress: Progress) -> list[float]:
    s = settings.replace(grace_seconds=1.0, allow_unsafe_grace=True, upload_ttl_seconds=1.0,
                         events_topic=f"bench-{uuid.uuid4().hex[:6]}",
                         consumer_group=f"bench-{uuid.uuid4().hex[:6]}")
    await ensure_topics(s)
    tracker = Tracker(s, name="bench")
    tracker.start()
    # The stream starts once the tracker holds its partitions: the group join (seconds) is
    # a start-up cost, not the latency of a running system.
    await asyncio.wait_for(tracker.assigned_event.wait(), 60)
    stop = asyncio.Event()
    latencies: list[float] = []
    reaper = Reaper(s, reaper_id="bench-latency")

    async def reap_loop() -> None:
        while not stop.is_set():
            report = await reaper.run_once()
            for repo in report.repos:
                latencies.extend(repo.latencies_s)
            if not report.total("claimed"):
                await asyncio.sleep(0.05)

    loop = asyncio.create_task(reap_loop())
    try:
        async with Publisher(s) as pub:
            svc = ModelService(s, s3_client(s), pub, model=Model.from_settings(s))
            await svc.call(Model.create_repository, "lat", "s3://bench-latency/lat/")
            task = progress.add_task("write + delete through the model service", total=m)
            t0 = time.monotonic()
            for i in range(m):
                # A steady stream, so garbage appears over time rather than in one burst.
                await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
                await svc.call(Model.write, "lat", "main", f"p{i}", 1)
                await svc.call(Model.delete, "lat", "main", f"p{i}")
                progress.advance(task)
        deadline = time.monotonic() + 120
        while len(latencies) < m and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await loop
        await reaper.close()
        await tracker.stop()
    return latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=20_000, help="N objects per contender")
    ap.add_argument("--latency-objects", type=int, default=600)
    ap.add_argument("--latency-rate", type=float, default=40.0,
                    help="write+delete pairs per second in the latency phase")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4,
                    help="interleaved raw/reaper rounds (the server's speed drifts)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configure_logging("console", "warning")
    con = Console(stderr=True)
    base = load_settings(env={}, grace_seconds=0.0, allow_unsafe_grace=True,
                         reaper_concurrency=args.concurrency)
    with embedded_stack(base) as st:
        s = st.settings
        s3 = s3_client(s, max_pool=32)
        bucket = "bench"
        s3.create_bucket(Bucket=bucket)
        n = args.objects
        rounds = max(1, args.rounds)
        per = n // rounds
        raw_keys = [[f"raw{k}/data/0/{i:08d}" for i in range(per)] for k in range(rounds)]
        reap_keys = [[f"repo{k}/data/0/{i:08d}" for i in range(per)] for k in range(rounds)]
        obs_keys = [[f"obs{k}/data/0/{i:08d}" for i in range(per)] for k in range(rounds)]
        with Progress(console=con, transient=True) as progress:
            _put_all(s3, bucket, [k for ks in raw_keys + reap_keys + obs_keys for k in ks],
                     progress)
        raw_s: list[float] = []
        reap_s: list[float] = []
        obs_s: list[float] = []
        left = 0
        for k in range(rounds):
            raw_s.append(_raw_delete(s3, bucket, raw_keys[k]))
            obs_s.append(_obstore_delete(s, bucket, obs_keys[k]))
            _track_as_garbage(s, f"bench{k}", f"s3://{bucket}/repo{k}/",
                              [f"s3://{bucket}/{key}" for key in reap_keys[k]])
            reap_s.append(asyncio.run(_reap_all(s, per)))
            left += s3.list_objects_v2(Bucket=bucket, Prefix=f"repo{k}/").get("KeyCount", 0)
        with Progress(console=con, transient=True) as progress:
            run = _latency(s, args.latency_objects, args.latency_rate, progress)
            lat = sorted(asyncio.run(run))

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else float("nan")

    result = {
        "objects": per * rounds, "rounds": rounds, "concurrency": args.concurrency,
        "raw_deletes_per_s": round(per * rounds / sum(raw_s)),
        "reaper_deletes_per_s": round(per * rounds / sum(reap_s)),
        "obstore_deletes_per_s": round(per * rounds / sum(obs_s)),
        "ratio": round(sum(raw_s) / sum(reap_s), 3),
        "ratio_to_obstore": round(sum(obs_s) / sum(reap_s), 3),
        "ratio_per_round": [round(a / b, 3) for a, b in zip(raw_s, reap_s, strict=True)],
        "left_after_reaper": left,
        "latency_objects": len(lat), "latency_rate_per_s": args.latency_rate, "grace_s": 1.0,
        "latency_s": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
                      "max": round(lat[-1], 3) if lat else None},
    }
    if args.json:
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
        return
    t = Table(title=f"reaper vs raw delete_objects, {per * rounds:,} objects each, "
                    f"{rounds} interleaved rounds")
    t.add_column("contender")
    t.add_column("deletes/s", justify="right")
    t.add_row("raw boto3 delete_objects loop", f"{result['raw_deletes_per_s']:,}")
    t.add_row("raw obstore bulk delete loop (the faster limit)",
              f"{result['obstore_deletes_per_s']:,}")
    t.add_row(f"reaper (claim + delete + complete, concurrency {args.concurrency})",
              f"{result['reaper_deletes_per_s']:,}")
    t.add_row("reaper / raw boto3", f"{result['ratio']:.2f}")
    t.add_row("reaper / raw obstore", f"{result['ratio_to_obstore']:.2f}")
    t.add_row("reaper / raw per round", ", ".join(f"{x:.2f}" for x in result["ratio_per_round"]))
    Console().print(t)
    lt = Table(title=f"unreferenced -> deleted, {len(lat)} objects, grace 1 s (live tracker)")
    for col in ("p50", "p90", "p99", "max"):
        lt.add_column(col, justify="right")
    lt.add_row(*(f"{result['latency_s'][c]} s" for c in ("p50", "p90", "p99", "max")))
    Console().print(lt)


if __name__ == "__main__":
    main()

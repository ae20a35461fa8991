"""Reconciler benchmark: wall time and peak memory of a mark (and optionally the sweep) as the
namespace grows, next to the raw limit measured in the same run.

    python -m sim.bench_reconciler --objects 100000  # live listing of MinIO + raw listing
    python -m sim.bench_reconciler --objects 100000 --sweep  # ... and delete the garbage
    python -m sim.bench_reconciler --objects 1000000 --inventory
    python -m sim.bench_reconciler --objects 100000 --incremental  # clean, +1%, optimized

The namespace holds ``data/<slice>/<id>`` objects in slices of ``--per-slice``; by id: 50% are
in commit manifests (retained), 10% staged in a live token (Redis), 10% unreferenced (Redis
record, references ended), 30% leaked (no record). The mark must find exactly 40%.

* live mode: the embedded MinIO, filled by a child process with obstore (many PUTs in flight);
  the reconciler lists it through HTTP from Spark tasks. The raw bars: one paginated boto3
  ``list_objects_v2`` loop over the same namespace in one process, and beside it the same
  listing by obstore (Rust object_store), the faster limit.
* inventory mode: S3-Inventory-style Parquet files (key, size, last_modified) are generated
  locally by a child process; manifests live on MinIO. The raw bar: one pyarrow scan of the
  same inventory files in one process.

The raw bar runs in a child process before the reconcile, over the same namespace. With
``--sweep``, a second raw bar after it: as many fresh objects as the sweep confirmed, deleted
by one boto3 ``delete_objects`` loop (1,000 keys a request, one thread, no re-check) on the
same server; the sweep's rate is given against it (``sweep_ratio_vs_raw_delete``: the whole
sweep, re-validation and the online pre-check included; ``delete_ratio_vs_raw_delete``: its
deleting pass alone).
With ``--incremental`` (issue 37 part 4): a clean mark and sweep (the baseline), then
``--change`` (1%) more objects in new slices, of the same roles, their committed ones in one
new commit on top; then an optimized dry run and a clean dry run of the changed namespace in
the same Spark session. Their wall times, the ratio, and whether both marked the same keys.
Memory: peak RSS (``VmHWM``) of this driver Python process and of the Spark JVM (its child
process); Spark's Python workers are children of the JVM and are sampled separately (peak of
their summed RSS).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

BUCKET = "bench"
PREFIX = "ns/"
REPO = "bench"
COMMITTED, STAGED, UNREFERENCED = range(5), (5,), (6,)


def key_of(i: int, per_slice: int) -> str:
    return f"{PREFIX}data/{9_000_000_000 - i // per_slice:010d}/{i:010d}"


def role(i: int) -> str:
    r = i % 10
    if r in COMMITTED:
        return "committed"
    if r in STAGED:
        return "staged"
    if r in UNREFERENCED:
        return "unreferenced"
    return "leaked"


# ------------------------------------------------------------------------- /proc helpers

def _status(pid: int) -> dict[str, str]:
    out = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def _kb(value: str | None) -> int:
    return int(value.split()[0]) if value else 0


def peak_rss_mib(pid: int) -> float:
    return _kb(_status(pid).get("VmHWM")) / 1024


def rss_mib(pid: int) -> float:
    return _kb(_status(pid).get("VmRSS")) / 1024


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{d}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(d))
    return out


def jvm_pid() -> int | None:
    for c in children(os.getpid()):
        if _status(c).get("Name", "").startswith("java"):
            return c
    return None


class WorkerSampler(threading.Thread):
    """Peak of the summed RSS of the JVM's Python worker processes."""

    def __init__(self, jvm: int | None) -> None:
        super().__init__(daemon=True)
        self.jvm = jvm
        self.peak = 0.0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(0.5) and self.jvm:
            total = 0.0
            stack = children(self.jvm)
            while stack:
                p = stack.pop()
                total += rss_mib(p)
                stack.extend(children(p))
            self.peak = max(self.peak, total)


# --------------------------------------------------------------------------- preparation

def _manifests(n: int, per_manifest: int, per_slice: int) -> Iterator[tuple[str, list[str]]]:
    committed = [i for i in range(n) if role(i) == "committed"]
    for m in range(0, len(committed), per_manifest):
        chunk = committed[m:m + per_manifest]
        yield f"{PREFIX}_hardelete/manifests/m{m // per_manifest:05d}.parquet", [
            f"s3://{BUCKET}/{key_of(i, per_slice)}" for i in chunk]


def _manifest_body(addresses: list[str]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"path": [f"p/{i}" for i in range(len(addresses))],
                             "address": addresses,
                             "size": pa.array([100] * len(addresses), pa.int64())}), buf)
    return buf.getvalue()


def _change_manifest(n: int, extra: int, per_slice: int) -> tuple[str, list[str]]:
    return f"{PREFIX}_hardelete/manifests/incr-{n}.parquet", [
        f"s3://{BUCKET}/{key_of(i, per_slice)}" for i in range(n, n + extra)
        if role(i) == "committed"]


def change(endpoint: str, redis_url: str, n: int, extra: int, per_slice: int) -> None:
    """Child process: ``extra`` more objects (ids n..n+extra: new slices), their records, and
    a commit on top of main whose manifest holds their committed ones."""
    import asyncio

    import obstore
    import redis as redis_lib

    from schemas.layout import RepoKeys

    store = _store(endpoint)
    mkey, addresses = _change_manifest(n, extra, per_slice)

    async def run() -> None:
        sem = asyncio.Semaphore(32)

        async def put(key: str, body: bytes) -> None:
            async with sem:
                await obstore.put_async(store, key, body)

        await asyncio.gather(*(put(key_of(i, per_slice), b"x" * 100)
                               for i in range(n, n + extra)))
        await put(mkey, _manifest_body(addresses))

    asyncio.run(run())
    r = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    k = RepoKeys(REPO)
    head = orjson.loads(r.hget(k.branches, "main") or "{}")["head"]
    r.hset(k.commits, "c-incr", orjson.dumps({
        "parents": [head], "time": time.time(), "branch": "main",
        "manifest": f"s3://{BUCKET}/{mkey}"}))
    r.hset(k.branches, "main", orjson.dumps({"head": "c-incr", "staging_token": "t-open",
                                             "sealed_tokens": []}))
    _records(r, k, range(n, n + extra), per_slice)
    r.close()


def _records(r: Any, k: Any, ids: Any, per_slice: int) -> None:
    pipe = r.pipeline(transaction=False)
    for i in ids:
        ro = role(i)
        if ro not in ("staged", "unreferenced"):
            continue
        addr = f"s3://{BUCKET}/{key_of(i, per_slice)}"
        if ro == "staged":
            pipe.hset(k.address(addr), mapping={f"+r{i}": "t-open", "state": "staged",
                                                 "size": "100"})
        else:
            pipe.hset(k.address(addr), mapping={f"+r{i}": "t-old", "state": "unreferenced",
                                                 "since": "1", "size": "100"})
        if len(pipe) >= 5000:
            pipe.execute()
    pipe.execute()


def fill_redis(redis_url: str, n: int, per_manifest: int, per_slice: int) -> None:
    """Tracker state: repo, a commit per manifest (one chain on main), live/ended records."""
    import redis as redis_lib

    from schemas.layout import PROGRESS, PROGRESS_META, REPOS, RepoKeys

    r = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    k = RepoKeys(REPO)
    r.sadd(REPOS, REPO)  # a live repository (the reconciler refuses others)
    r.hset(k.meta, mapping={"namespace": f"s3://{BUCKET}/{PREFIX}", "default_branch": "main",
                            "default_retention_days": "100000", "branch_retention": "{}"})
    now = time.time()
    prev: str | None = None
    for j, (mkey, _) in enumerate(_manifests(n, per_manifest, per_slice)):
        cid = f"c{j:05d}"
        r.hset(k.commits, cid, orjson.dumps({
            "parents": [prev] if prev else [], "time": now - 3600 + j, "branch": "main",
            "manifest": f"s3://{BUCKET}/{mkey}"}))
        prev = cid
    r.hset(k.branches, "main", orjson.dumps({"head": prev, "staging_token": "t-open",
                                             "sealed_tokens": []}))
    r.hset(k.tokens, mapping={"t-open": "open:1", "t-old": "dropped:1"})
    _records(r, k, range(n), per_slice)
    r.hset(PROGRESS_META, mapping={"topic": "bench", "partitions": "1"})
    r.hset(PROGRESS, "0", str(int((now + 86_400) * 1000)))
    r.close()


def _store(endpoint: str) -> Any:
    from obstore.store import S3Store

    from core.settings import load_settings

    st = load_settings(env={})
    return S3Store(BUCKET, endpoint=endpoint, region=st.s3_region,
                   access_key_id=st.s3_access_key, secret_access_key=st.s3_secret_key,
                   client_options={"allow_http": True})


def fill_minio(endpoint: str, n: int, per_manifest: int, per_slice: int, objects: bool) -> None:
    """Child process: the bucket on MinIO, its objects (when listing live) and manifests, PUT
    by obstore with many requests in flight (boto3 PUTs ~500/s here, obstore ~2,800/s)."""
    import asyncio

    import obstore

    from core.clients import s3_client
    from core.settings import load_settings

    s3_client(load_settings(env={}, s3_endpoint_url=endpoint)).create_bucket(Bucket=BUCKET)
    store = _store(endpoint)

    async def run() -> None:
        sem = asyncio.Semaphore(32)

        async def put(key: str, body: bytes) -> None:
            async with sem:
                await obstore.put_async(store, key, body)

        body = b"x" * 100
        if objects:
            step = 20_000
            for lo in range(0, n, step):
                await asyncio.gather(*(put(key_of(i, per_slice), body)
                                       for i in range(lo, min(n, lo + step))))
        await asyncio.gather(*(put(mkey, _manifest_body(addresses))
                               for mkey, addresses in _manifests(n, per_manifest, per_slice)))

    asyncio.run(run())


def write_inventory(path: str, n: int, per_slice: int, files: int) -> None:
    """Child process: S3-Inventory-style Parquet files for n objects."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    old = int((time.time() - 30 * 86_400) * 1000)
    per_file = -(-n // files)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        lo, hi = f * per_file, min(n, (f + 1) * per_file)
        if lo >= hi:
            break
        keys = [key_of(i, per_slice) for i in range(lo, hi)]
        pq.write_table(pa.table({"bucket": pa.array([BUCKET] * len(keys)),
                                 "key": keys,
                                 "size": pa.array([100] * len(keys), pa.int64()),
                                 "last_modified": pa.array([old] * len(keys), pa.int64())}),
                       out / f"inventory-{f:04d}.parquet", compression="zstd")


def raw_bar(endpoint: str, inventory_dir: str) -> dict[str, Any]:
    """Child process: the raw limit, one thread: a paginated listing or an inventory scan."""
    t0 = time.monotonic()
    if inventory_dir:
        import pyarrow.parquet as pq

        n = sum(pq.read_table(f, columns=["key", "size", "last_modified"]).num_rows
                for f in sorted(Path(inventory_dir).glob("*.parquet")))
        what = "pyarrow read of the inventory files (1 process)"
    else:
        import obstore

        from core.clients import s3_client
        from core.settings import load_settings
        from reconciler.listing import raw_listing_count
        from reconciler.s3io import Namespace

        s3 = s3_client(load_settings(env={}, s3_endpoint_url=endpoint))
        n, _ = raw_listing_count(s3, Namespace(f"s3://{BUCKET}/{PREFIX}"))
        what = "paginated boto3 list_objects_v2 of the namespace (1 thread)"
        secs = time.monotonic() - t0
        # beside it the faster limit: the same listing by obstore (Rust object_store)
        t1 = time.monotonic()
        m = sum(len(batch) for batch in obstore.list(_store(endpoint), prefix=PREFIX))
        osecs = time.monotonic() - t1
        return {"what": what, "objects": n, "seconds": round(secs, 2),
                "objects_per_s": round(n / secs),
                "obstore": {"objects": m, "seconds": round(osecs, 2),
                            "objects_per_s": round(m / osecs)}}
    secs = time.monotonic() - t0
    return {"what": what, "objects": n, "seconds": round(secs, 2),
            "objects_per_s": round(n / secs)}


def raw_delete(endpoint: str, n: int) -> dict[str, Any]:
    """Child process: ``n`` fresh objects PUT by obstore (not timed), then deleted by one
    boto3 ``delete_objects`` loop, one thread, 1,000 keys a request (timed)."""
    import asyncio

    import obstore

    from core.clients import s3_client
    from core.settings import load_settings

    store = _store(endpoint)
    keys = [f"{PREFIX}rawdel/{i:010d}" for i in range(n)]

    async def fill() -> None:
        sem = asyncio.Semaphore(32)

        async def put(key: str) -> None:
            async with sem:
                await obstore.put_async(store, key, b"x" * 100)

        await asyncio.gather(*(put(k) for k in keys))

    asyncio.run(fill())
    s3 = s3_client(load_settings(env={}, s3_endpoint_url=endpoint))
    t0 = time.monotonic()
    deleted = 0
    for lo in range(0, n, 1000):
        resp = s3.delete_objects(Bucket=BUCKET, Delete={
            "Objects": [{"Key": k} for k in keys[lo:lo + 1000]], "Quiet": False})
        deleted += len(resp.get("Deleted", ()))
    secs = time.monotonic() - t0
    return {"what": "boto3 delete_objects loop, 1,000 keys a request (1 thread)",
            "objects": deleted, "seconds": round(secs, 2),
            "objects_per_s": round(deleted / secs) if secs else 0}


def _child(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "sim.bench_reconciler", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


# ----------------------------------------------------------------------------------- main

def bench(n: int, *, inventory: bool, sweep: bool, per_slice: int, per_manifest: int,
          files: int, incremental: float = 0.0) -> dict[str, Any]:
    from core.settings import load_settings
    from reconciler.job import RunOptions, reconcile
    from reconciler.spark import get_spark
    from sim.stack import minio_server, redis_server

    work = Path(tempfile.mkdtemp(prefix="hardelete-bench-"))
    redis = redis_server(work)
    redis.start()
    minio = minio_server(work)
    minio.start()
    endpoint = f"http://127.0.0.1:{minio.port}"
    try:
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "sim.bench_reconciler", "_fill", endpoint, str(n),
                        str(per_manifest), str(per_slice), "0" if inventory else "1"],
                       check=True)
        inv_dir = str(work / "inventory")
        if inventory:
            subprocess.run([sys.executable, "-m", "sim.bench_reconciler", "_inventory", inv_dir,
                            str(n), str(per_slice), str(files)], check=True)
        subprocess.run([sys.executable, "-m", "sim.bench_reconciler", "_redis",
                        f"redis://127.0.0.1:{redis.port}/0", str(n), str(per_manifest),
                        str(per_slice)], check=True)
        prepare_s = time.monotonic() - t0
        # the raw bar: the same namespace (or inventory), one process, before the run
        raw = orjson.loads(subprocess.run(
            [sys.executable, "-m", "sim.bench_reconciler", "_raw", endpoint,
             inv_dir if inventory else ""], check=True, capture_output=True, text=True).stdout)
        settings = load_settings(env={}, redis_url=f"redis://127.0.0.1:{redis.port}/0",
                                 s3_endpoint_url=endpoint,
                                 reconcile_min_age_seconds=0.0, log_level="warning")
        t0 = time.monotonic()
        spark = get_spark(settings, shuffle_partitions=8)
        spark_start_s = time.monotonic() - t0
        jvm = jvm_pid()
        sampler = WorkerSampler(jvm)
        sampler.start()
        cutoff = int(time.time() * 1000)
        # the bench measures throughput: the blast-radius guard is the operator's, not ours
        opts = RunOptions(REPO, dry_run=not sweep, cutoff_ms=cutoff,
                          inventory=inv_dir if inventory else None, allow_large_sweep=True)
        t0 = time.monotonic()
        summary = reconcile(spark, settings, opts)
        wall = time.monotonic() - t0
        sampler.stop_event.set()
        sampler.join()
        driver_peak = peak_rss_mib(os.getpid())
        jvm_peak = peak_rss_mib(jvm) if jvm else 0.0
        if not summary.get("success"):
            raise RuntimeError(f"the run failed: {summary.get('error')}")
        marked = summary["mark"]["marked"]
        sweep_s = (summary.get("sweep") or {}).get("seconds")
        confirmed = (summary.get("sweep") or {}).get("confirmed") or 0
        timings = summary.get("timings") or {}
        raw_del: dict[str, Any] | None = None
        sweep_cmp: dict[str, Any] = {}
        if sweep and confirmed:
            # the deleter's raw limit on the same server, right after the run
            raw_del = orjson.loads(subprocess.run(
                [sys.executable, "-m", "sim.bench_reconciler", "_rawdel", endpoint,
                 str(confirmed)], check=True, capture_output=True, text=True).stdout)
            sweep_cmp = {
                "sweep_objects_per_s": round(confirmed / sweep_s) if sweep_s else None,
                "sweep_ratio_vs_raw_delete": round(confirmed / sweep_s
                                                   / raw_del["objects_per_s"], 3)
                if sweep_s else None,
                "delete_ratio_vs_raw_delete": round(confirmed / timings["sweep_delete_s"]
                                                    / raw_del["objects_per_s"], 3)
                if timings.get("sweep_delete_s") else None}
        expected = sum(1 for i in range(n) if role(i) in ("unreferenced", "leaked"))
        listed = summary["mark"]["listed"]
        incr = (_incremental(spark, settings, endpoint, f"redis://127.0.0.1:{redis.port}/0",
                             n, max(1, int(n * incremental)), per_slice, wall)
                if incremental else None)
        return {
            "objects": n, "input": "inventory" if inventory else "s3 listing (MinIO)",
            "mode": "mark+sweep" if sweep else "mark (dry run)",
            "listed": listed, "marked": marked, "marked_expected": expected,
            "exact": marked == expected,
            "swept_confirmed": (summary.get("sweep") or {}).get("confirmed"),
            "wall_s": round(wall, 2), "objects_per_s": round(listed / wall),
            "timings": summary.get("timings"),
            "sweep_s": sweep_s,
            "raw_delete": raw_del, **sweep_cmp,
            "driver_peak_rss_mib": round(driver_peak, 1), "jvm_peak_rss_mib": round(jvm_peak, 1),
            "python_workers_peak_rss_mib": round(sampler.peak, 1),
            "raw": raw,
            "ratio_vs_raw": round((listed / wall) / raw["objects_per_s"], 3),
            "prepare_s": round(prepare_s, 1), "spark_start_s": round(spark_start_s, 1),
            "cores": os.cpu_count(),
            **({"incremental": incr} if incr else {}),
        }
    finally:
        minio.stop()
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)


def _marked_keys(s3: Any, summary: dict[str, Any]) -> set[str]:
    from reconciler.s3io import read_parquet_rows

    return {row[0] for part in summary["mark"]["parts"]
            for row in read_parquet_rows(s3, BUCKET, part, ("key",))}


def _incremental(spark: Any, settings: Any, endpoint: str, redis_url: str, n: int,
                 extra: int, per_slice: int, baseline_wall: float) -> dict[str, Any]:
    """After the clean run (mark + sweep): ``extra`` more objects, then an optimized dry
    run and a clean dry run of the changed namespace, timed, and their marks compared."""
    from core.clients import s3_client
    from reconciler.job import RunOptions, reconcile

    subprocess.run([sys.executable, "-m", "sim.bench_reconciler", "_change", endpoint,
                    redis_url, str(n), str(extra), str(per_slice)], check=True)
    cutoff = (int(time.time()) + 1) * 1000  # after every object written (whole seconds)
    while time.time() * 1000 < cutoff + 5:
        time.sleep(0.05)
    out: dict[str, Any] = {"baseline_mark_and_sweep_s": round(baseline_wall, 2),
                           "changed_objects": extra}
    marks = {}
    for name, optimized in (("optimized", True), ("clean", False)):
        t0 = time.monotonic()
        summary = reconcile(spark, settings, RunOptions(REPO, dry_run=True, cutoff_ms=cutoff,
                                                        optimized=optimized,
                                                        allow_large_sweep=True))
        wall = time.monotonic() - t0
        if not summary.get("success"):
            raise RuntimeError(f"the {name} run failed: {summary.get('error')}")
        marks[name] = _marked_keys(s3_client(settings), summary)
        out[name] = {"mode": summary["mode"], "mode_note": summary.get("mode_note"),
                     "wall_s": round(wall, 2), "listed": summary["mark"]["listed"],
                     "marked": summary["mark"]["marked"],
                     "manifests_read": next((s.get("files") for s in
                                             summary["keepset"]["sources"]
                                             if s["kind"] == "manifests"), None),
                     "timings": summary.get("timings")}
    expected = sum(1 for i in range(n, n + extra) if role(i) in ("unreferenced", "leaked"))
    out["same_mark"] = marks["optimized"] == marks["clean"]
    out["marked_expected"] = expected
    out["ratio_optimized_to_clean"] = round(out["optimized"]["wall_s"]
                                            / out["clean"]["wall_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_fill":
        endpoint, n, pm, ps, objs = argv[1:6]
        fill_minio(endpoint, int(n), int(pm), int(ps), objs == "1")
        return 0
    if argv and argv[0] == "_inventory":
        write_inventory(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    if argv and argv[0] == "_raw":
        print(orjson.dumps(raw_bar(argv[1], argv[2] if len(argv) > 2 else "")).decode())
        return 0
    if argv and argv[0] == "_rawdel":
        print(orjson.dumps(raw_delete(argv[1], int(argv[2]))).decode())
        return 0
    if argv and argv[0] == "_change":
        change(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]))
        return 0
    if argv and argv[0] == "_redis":
        fill_redis(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m sim.bench_reconciler", description=__doc__)
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--inventory", action="store_true",
                        help="list from generated inventory files instead of S3")
    parser.add_argument("--sweep", action="store_true", help="also delete (live mode)")
    parser.add_argument("--per-slice", type=int, default=10_000)
    parser.add_argument("--per-manifest", type=int, default=250_000)
    parser.add_argument("--files", type=int, default=0,
                        help="inventory files (default: one per 10^6 objects, at least 4)")
    parser.add_argument("--incremental", action="store_true",
                        help="after the clean mark and sweep: change --change of the objects, "
                             "then time an optimized and a clean dry run of the result")
    parser.add_argument("--change", type=float, default=0.01,
                        help="share of new objects for --incremental (default 0.01)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.incremental:
        if args.inventory:
            parser.error("--incremental lists the live objects (not --inventory)")
        args.sweep = True  # the optimized run's baseline is a swept run
    if args.sweep and args.inventory:
        parser.error("--sweep needs the live objects (not --inventory)")
    files = args.files or max(4, args.objects // 1_000_000)
    result = bench(args.objects, inventory=args.inventory, sweep=args.sweep,
                   per_slice=args.per_slice, per_manifest=args.per_manifest, files=files,
                   incremental=args.change if args.incremental else 0.0)
    if args.json:
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    else:
        for k, v in result.items():
            print(f"{k:28} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: the embedded S3 server, plain moto against ``sim.moto_speedups``.

    ./dev bench s3 --objects 50000

Each server runs alone, on a fresh port, and gets the same work from one client: PUTs of
small objects spread over a few prefixes (16 in flight), then full paginated listings of
the bucket (the first one renders every object; the later ones are what the soak's checks
and the broker's fetches do: list objects already listed), then listings of one prefix.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from core.clients import s3_client
from core.settings import load_settings
from sim.stack import moto_server

BUCKET = "bench-s3"
PREFIXES = 8


@dataclass
class Figures:
    puts_per_s: float
    first_listing_keys_per_s: float
    later_listing_keys_per_s: float
    prefix_listing_keys_per_s: float


def _list(s3: Any, prefix: str = "") -> int:
    n = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        n += len(page.get("Contents", []))
    return n


def _timed(fn: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = fn()
    return n, time.perf_counter() - t0


def measure(speedups: bool, objects: int, workdir: Path) -> Figures:
    server = moto_server(workdir, speedups=speedups)
    server.start()
    try:
        s3 = s3_client(load_settings(env={}, s3_endpoint_url=f"http://127.0.0.1:{server.port}"))
        s3.create_bucket(Bucket=BUCKET)

        def put(i: int) -> None:
            s3.put_object(Bucket=BUCKET, Key=f"repo-{i % PREFIXES}/data/{i:09d}", Body=b"x")

        def put_all() -> int:
            with cf.ThreadPoolExecutor(16) as pool:
                list(pool.map(put, range(objects)))
            return objects

        n, put_s = _timed(put_all)
        n1, first = _timed(lambda: _list(s3))
        later = [_timed(lambda: _list(s3)) for _ in range(2)]
        prefix = [_timed(lambda: _list(s3, "repo-3/")) for _ in range(2)]
        if n1 != objects or any(k != objects for k, _ in later):
            raise RuntimeError(f"the server listed {n1} keys, not the {objects} written")
        return Figures(
            puts_per_s=n / put_s,
            first_listing_keys_per_s=n1 / first,
            later_listing_keys_per_s=sum(k for k, _ in later) / sum(s for _, s in later),
            prefix_listing_keys_per_s=sum(k for k, _ in prefix) / sum(s for _, s in prefix),
        )
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=50_000)
    args = parser.parse_args(argv)
    if args.objects < PREFIXES:
        parser.error(f"--objects must be at least {PREFIXES}")
    console = Console(stderr=True)
    results: dict[str, Figures] = {}
    with tempfile.TemporaryDirectory(prefix="hardelete-s3-bench-") as wd:
        for name, speedups in (("moto", False), ("moto + speedups", True)):
            with console.status(f"s3 bench: {name}, {args.objects:,} objects"):
                results[name] = measure(speedups, args.objects, Path(wd))
    table = Table(title=f"embedded S3 server, {args.objects:,} objects, one client")
    table.add_column("")
    for name in results:
        table.add_column(name, justify="right")
    table.add_column("ratio", justify="right")
    plain, fast = results["moto"], results["moto + speedups"]
    for label, field in (("PUT/s (16 in flight)", "puts_per_s"),
                         ("first full listing, keys/s", "first_listing_keys_per_s"),
                         ("later full listings, keys/s", "later_listing_keys_per_s"),
                         ("one prefix (1/8), keys/s", "prefix_listing_keys_per_s")):
        a, b = getattr(plain, field), getattr(fast, field)
        table.add_row(label, f"{a:,.0f}", f"{b:,.0f}", f"{b / a:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()

"""Helpers for the operator commands' tests on the real stack: run the CLI in-process, or while
a tracker runs; a repository, dead-lettered events and garbage made by the real tracker and
model service; reaper passes until a condition; what a store, a pass report and a hold hold."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from core.settings import Settings
from hardelete.cli import main
from reaper.daemon import PassReport, Reaper
from schemas.events import ObjectDeleted, ObjectWritten, RepositoryCreated, encode
from schemas.layout import RepoKeys
from schemas.publisher import Publisher, ensure_topics
from sim.model import Model, ModelService
from tracker.daemon import Tracker, running_tracker

if TYPE_CHECKING:
    import pytest


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def created(repo: str, ns: str, **kw: Any) -> RepositoryCreated:
    return RepositoryCreated(repository=repo, storage_namespace=ns, default_branch="main",
                             default_retention_days=7, **kw)


def written(repo: str, address: str, size: int = 3, *, token: str = "t1",
            ref: str = "r1") -> ObjectWritten:
    return ObjectWritten(repository=repo, branch="main", staging_token=token, path="p",
                         address=address, size=size, ref_id=ref)


def deleted(repo: str, address: str, *, token: str = "t1", ref: str = "r1") -> ObjectDeleted:
    return ObjectDeleted(repository=repo, branch="main", staging_token=token, path="p",
                         address=address, ref_id=ref)


def tracked(s: Settings, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run a command while a tracker runs: ``dlq resolve`` waits for the tracker to have applied
    what was published before it (a replayed fix), as an operator's running tracker does."""
    async def go() -> tuple[int, str, str]:
        async with running_tracker(s):
            return await asyncio.to_thread(run, capsys, *argv)
    return asyncio.run(go())


async def publish_and_track(s: Settings, *values: tuple[bytes, bytes]) -> None:
    await ensure_topics(s)
    async with Publisher(s) as pub:
        for value, key in values:
            await pub.publish_raw(value, key)
    await Tracker(s).run_until_caught_up()


def setup_repo(s: Settings, repo: str = "ops", ns: str = "s3://opsb/ns/", *,
               bucket: bool = True) -> None:
    """A tracked repository whose namespace's bucket exists (its durable facts live there;
    ``bucket=False``: a repository whose bucket is gone)."""
    from contextlib import suppress

    from core.clients import s3_client, split_s3_uri

    if bucket:
        client = s3_client(s)
        with suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=split_s3_uri(ns)[0])
    ev = created(repo, ns)
    asyncio.run(publish_and_track(s, (encode(ev), ev.key)))


def broken(repo: str, address: Any, size: int = -1) -> bytes:
    """An object_written the tracker dead-letters (a negative size), naming ``address``."""
    body = orjson.loads(encode(written(repo, "s3://x/y")))
    body["address"], body["size"] = address, size
    return orjson.dumps(body)


async def make_garbage(s: Settings, s3: Any, model: Model, repo: str, paths: list[str],
                       namespace: str | None = None) -> list[str | None]:
    """Objects written through the model service and deleted again: the tracker makes them
    unreferenced, the reaper takes them after grace."""
    await ensure_topics(s)
    async with Publisher(s) as pub:
        svc = ModelService(s, s3, pub, model=model)
        if namespace is not None:
            await svc.call(Model.create_repository, repo, namespace)
        out: list[str | None] = []
        for path in paths:
            out.append((await svc.call(Model.write, repo, "main", path, 3)).address)
            await svc.call(Model.delete, repo, "main", path)
    return out


async def reap_until(s: Settings, done: Callable[[PassReport], bool],
                     timeout: float = 45.0) -> PassReport:
    """The real tracker and reaper run until a reaper pass satisfies ``done``."""
    async with running_tracker(s):
        reaper = Reaper(s)
        try:
            deadline = time.monotonic() + timeout
            while True:
                report = await reaper.run_once()
                if done(report):
                    return report
                assert time.monotonic() < deadline, report.as_dict()
                await asyncio.sleep(0.1)
        finally:
            await reaper.close()


def stored(s3: Any, address: str) -> bool:
    bucket, _, key = address.removeprefix("s3://").partition("/")
    return "Contents" in s3.list_objects_v2(Bucket=bucket, Prefix=key)


def kept(report: PassReport, repo: str, reason: str) -> int:
    return sum(r.kept[reason] for r in report.repos if r.repository == repo)


def claims(redis_client: Any, repo: str, target: str, prefix: bool = False) -> set[str]:
    k = RepoKeys(repo)
    raw = redis_client.hget(k.hold_prefixes if prefix else k.holds, target)
    return set(orjson.loads(raw)["claims"]) if raw is not None else set()

"""The image built from the repository (compose/Dockerfile, podman, sim/image.py) runs each
component against the embedded stack's servers: the demo's workload goes through a
containerised tracker and reaper (0 live deleted, the online garbage reclaimed), then a
containerised reconciler run sweeps the rest. The compose stack comes up with podman-compose
on images made the same way (compose/podman/). Slow (minutes, the image build included):
``./dev image`` runs them; ``./dev test`` leaves them out (the ``image`` mark)."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import orjson
import pytest
from rich.console import Console

from core.clients import redis_async
from core.clock import atracker_horizon_ms
from core.settings import Settings
from schemas.publisher import ensure_topics
from sim.demo import DemoOptions, expected_sweep, run_model_phase
from sim.image import (
    COMPOSE_FILES,
    Container,
    build_image,
    compose_images,
    container_env,
    containers_conf,
    podman,
    run,
    start,
)
from sim.model import ModelService
from sim.stack import free_port
from sim.testing import redis_now, wait_for

pytestmark = [pytest.mark.image, pytest.mark.slow]


@pytest.fixture(scope="module")
def image() -> str:
    """The image ``./dev image`` built (HARDELETE_IMAGE), else built here."""
    return os.environ.get("HARDELETE_IMAGE") or build_image()


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    started: list[Container] = []
    yield started
    for c in started:
        c.remove()


def test_the_image_runs_the_demo_workload(settings: Settings, image: str,
                                          containers: list[Container]) -> None:
    s = settings.replace(grace_seconds=1.0, upload_ttl_seconds=1.0,
                         reconcile_min_age_seconds=0.0, uncommitted_export="namespace")
    options = DemoOptions(seed=7, ops=120, run_id=uuid.uuid4().hex[:8], grace_seconds=1.0,
                          upload_ttl_seconds=1.0)
    asyncio.run(_workload(s, options, image, containers))


def _daemon(image: str, s: Settings, what: str, containers: list[Container]) -> Container:
    env = {**container_env(s), "HARDELETE_METRICS_PORT": str(free_port())}
    c = start(image, [what, "run"], env, name=f"hardelete-test-{what}-{uuid.uuid4().hex[:6]}")
    containers.append(c)
    return c


def _healthy(c: Container, what: str) -> None:
    """The healthcheck compose and Kubernetes run, inside the container."""
    proc = c.exec(["hardelete", "health", what])
    assert proc.returncode == 0, f"health {what}: {proc.stdout}{proc.stderr}\n{c.logs()}"


async def _caught_up(s: Settings, tracker: Container) -> None:
    """The tracker's horizon passes now (a container that stopped fails at once, its log
    shown)."""
    target = await redis_now(s)
    r = redis_async(s)
    try:
        async def applied() -> bool:
            assert tracker.running(), tracker.logs()
            horizon = await atracker_horizon_ms(r)
            return horizon is not None and horizon >= target

        await wait_for(applied, timeout=120, what="the containerised tracker's horizon")
    finally:
        await r.aclose()


async def _workload(s: Settings, options: DemoOptions, image: str,
                    containers: list[Container]) -> None:
    await ensure_topics(s)
    tracker = _daemon(image, s, "tracker", containers)
    model, service = await run_model_phase(s, options, Console(file=io.StringIO()))
    assert model.store.ok, model.store
    await _caught_up(s, tracker)  # the tracker in the image applied it
    _healthy(tracker, "tracker")

    reaper = _daemon(image, s, "reaper", containers)
    written = service.model.truth().objects

    async def reclaimed() -> bool:
        assert reaper.running(), reaper.logs()
        truth = service.model.truth()
        gone = written - set(await _listing(service))
        return not (truth.online_garbage & written) - gone and not truth.issued_unexpired & written

    await wait_for(reclaimed, timeout=180, what="the containerised reaper's deletes")
    _healthy(reaper, "reaper")
    await _caught_up(s, tracker)  # the reaper's records of its deletes too
    truth = service.model.truth()
    garbage = truth.online_garbage & written
    gone = written - set(await _listing(service))
    assert garbage and gone == garbage, "the reaper deleted exactly the online garbage"
    assert reaper.stop() == 0, reaper.logs()  # SIGTERM to PID 1: a clean stop

    status = run(image, ["status", "--json"], container_env(s))
    assert status.returncode == 0, status.stderr
    repos = {r["repository"]: r for r in orjson.loads(status.stdout)["repositories"]}
    assert set(service.model.repositories) <= set(repos)
    assert all(repos[r]["incidents"] == 0 and not repos[r]["fail_closed"]
               for r in service.model.repositories), repos

    # The reconciler (local Spark in the image) sweeps what only it sees. Its cutoff is
    # requested before the service's export is written: Spark starts in the container after
    # the export, and an export must be younger than the run's cutoff to witness it.
    before = set(await _listing(service))
    expected: set[str] = set()
    for repo in sorted(service.model.repositories):
        cutoff = str((await redis_now(s) - 1) / 1000)
        await service.write_uncommitted_export(repo)
        proc = await asyncio.to_thread(
            run, image, ["reconcile", "--repo", repo, "--cutoff", cutoff, "--json"],
            container_env(s))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summary = orjson.loads(proc.stdout)
        assert summary["success"] and summary["sweep"]["status"] == "done", summary
        expected |= expected_sweep(service.model, repo, summary, s)
    expected &= before
    after = set(await _listing(service))
    assert expected, "the workload leaves garbage only the reconciler sees"
    assert before - after == expected, "the reconciler deleted exactly the rest of the garbage"
    assert tracker.stop() == 0, tracker.logs()


async def _listing(service: ModelService) -> list[str]:
    out: list[str] = []
    for repo in service.model.repositories:
        out += await service.list_namespace(repo)
    return out


def _podman_compose(project: str, *args: str, timeout: float = 600
                    ) -> subprocess.CompletedProcess[str]:
    files = [arg for f in COMPOSE_FILES for arg in ("-f", str(f))]
    env = {**os.environ, "CONTAINERS_CONF": str(containers_conf()),
           "HARDELETE_UPLOAD_TOKEN_SECRET": "image-test-secret"}
    binary = os.path.join(os.path.dirname(sys.executable), "podman-compose")  # the dev extra
    return subprocess.run([binary, "-p", project, *files, *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_the_compose_stack_comes_up_with_podman_compose(image: str) -> None:
    """compose.yaml with compose/podman/compose.podman.yaml laid over it (images built here;
    podman 4.3's limits in its header): every daemon's own health command passes inside its
    container and the tracker has joined its group."""
    images = compose_images(image)
    assert images["tracker"] == images["reaper"] == "hardelete:latest"
    project = f"hdtest{uuid.uuid4().hex[:6]}"
    try:
        up = _podman_compose(project, "up", "-d")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        deadline = time.monotonic() + 240
        waiting = ["tracker", "reaper", "reconciler"]
        while waiting:
            name = waiting[0]
            proc = podman(["exec", f"{project}_{name}_1", "hardelete", "health", name],
                          check=False, timeout=60)
            if proc.returncode == 0:
                waiting.pop(0)
            elif time.monotonic() > deadline:
                logs = podman(["logs", "--tail", "30", f"{project}_{name}_1"], check=False)
                raise AssertionError(f"{name} never healthy: {proc.stdout}{proc.stderr}\n"
                                     f"{logs.stdout}{logs.stderr}")
            else:
                time.sleep(2)  # (polling the container's own health command)
        init = podman(["inspect", "--format", "{{.State.ExitCode}}", f"{project}_minio-init_1"],
                      check=False)
        assert init.stdout.strip() == "0", "the bucket was made"
        status = podman(["exec", f"{project}_tracker_1", "hardelete", "status", "--json"],
                        check=False, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
    finally:
        _podman_compose(project, "down", "-v", "-t", "10", timeout=300)

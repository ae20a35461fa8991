"""Helpers for the reaper's tests on the real stack: the settings they run with (short upload
protection, grace and lease), the model service, an address's state in Redis, and garbage made
through the model service."""

from __future__ import annotations

from typing import Any

from core.clients import redis_async
from core.settings import Settings
from schemas.layout import AddressState, RepoKeys
from schemas.publisher import Publisher
from sim.model import Model, ModelService
from tracker.state import parse_address


def _settings(settings: Settings, **kw: Any) -> Settings:
    values: dict[str, Any] = {"upload_ttl_seconds": 1.0, "grace_seconds": 1.0,
                              "lease_seconds": 2.0}
    return settings.replace(**{**values, **kw})


async def _service(s: Settings, s3: Any, pub: Publisher) -> ModelService:
    return ModelService(s, s3, pub, model=Model.from_settings(s))


async def _state_is(s: Settings, repo: str, address: str, *states: AddressState) -> bool:
    r = redis_async(s)
    try:
        h = await r.hgetall(RepoKeys(repo).address(address))
    finally:
        await r.aclose()
    return bool(h) and parse_address(h).state in states


async def _many_garbage(s: Settings, s3: Any, bucket: str, n: int) -> tuple[list[str], str]:
    async with Publisher(s) as pub:
        svc = await _service(s, s3, pub)
        await svc.call(Model.create_repository, "repo", f"s3://{bucket}/repo/")
        keep = (await svc.call(Model.write, "repo", "main", "keep", 3)).address
        garbage = []
        for i in range(n):
            garbage.append((await svc.call(Model.write, "repo", "main", f"g{i}", 3)).address)
            await svc.call(Model.delete, "repo", "main", f"g{i}")
    assert keep
    return [a for a in garbage if a], keep

"""Notes of dead-lettered seqs (``hd:{R}:deadseq``) are bounded per repository: their seqs
come from the record, so a writer of the events topic could otherwise grow the hash without
end."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from core.clients import redis_async
from core.settings import Settings
from schemas.layout import DEAD_SEQS_MAX, RepoKeys
from tracker.deadletters import anote_dead_seqs

BOTH_TOPOLOGIES = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)


@BOTH_TOPOLOGIES
def test_dead_seq_notes_stop_at_the_bound_and_replace_their_own(
        settings: Settings, redis_client: Any) -> None:
    key = RepoKeys("r").dead_seqs

    async def note(fields: list[str], value: str = "{}") -> int:
        r = redis_async(settings)
        try:
            return await anote_dead_seqs(r, [(key, f, value) for f in fields])
        finally:
            await r.aclose()

    fields = [f"0:{seq}" for seq in range(1, DEAD_SEQS_MAX + 1)]
    assert asyncio.run(note(fields)) == DEAD_SEQS_MAX
    assert asyncio.run(note(["0:999999999"])) == 0  # full: a made-up seq is not noted
    assert redis_client.hlen(key) == DEAD_SEQS_MAX
    assert asyncio.run(note(["0:1"], '{"reason": "again"}')) == 1  # its own note is replaced
    assert redis_client.hget(key, "0:1") == '{"reason": "again"}'

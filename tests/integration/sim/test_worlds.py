"""The reconciler tests' worlds (``sim/worlds.py``) against the real Redis and S3 server: a
cutoff from :func:`boundary` comes after every upload expiry the world's tracker recorded.

Without it, an address whose upload was applied less than its ttl before the next whole second
stayed protected (``issued``) by a cutoff at that second, and
``test_reconcile_safety.py::test_an_address_unreferenced_inside_the_grace_window_is_not_marked``
found nothing to sweep in about one run in twenty."""

from __future__ import annotations

from typing import Any

from schemas.layout import RepoKeys
from sim.model import Model as M
from sim.worlds import BUCKET, boundary, call, make


def test_a_cutoff_comes_after_every_upload_expiry_the_tracker_recorded(
        settings: Any, s3: Any, redis_client: Any) -> None:
    w = make(settings, s3, redis_client)
    # A ttl longer than the rest of any second: a cutoff at the next whole second falls
    # inside the protection whenever the apply happened.
    w.model.upload_ttl_seconds = 1.5
    call(w, M.create_repository, "r", f"s3://{BUCKET}/worlds/r/")
    address = call(w, M.write, "r", "main", "a", 10).address
    w.track(None)
    expiry = int(redis_client.hget(RepoKeys("r").address(address), "iu"))
    assert expiry <= w.issued_until_ms
    assert boundary(w) > expiry

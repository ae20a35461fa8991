"""Bulk deletes against the real S3 server, through a fault-injecting HTTP proxy."""

from __future__ import annotations

import pytest

from reaper.deleter import S3Deleter


def test_batches_are_capped_at_1000() -> None:
    with pytest.raises(ValueError):
        S3Deleter(object(), batch_keys=1001)






# --- the one deleter core (core.gate) ---------------------------------------------------






"""The one deleter's plan refuses more than S3 accepts in one request."""

from __future__ import annotations

import pytest

from core.deleter import Plan


def test_batches_are_capped_at_1000() -> None:
    with pytest.raises(ValueError):
        Plan("s3://b/repo/", batch_keys=1001)

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.upload_tokens import UploadToken, UploadTokenError, sign, verify

ADDR = "s3://b/ns/data/1/x"


@given(st.text(min_size=1), st.floats(min_value=1, max_value=1e10))
def test_round_trip(token_id: str, exp: float) -> None:
    t = UploadToken(token_id, ADDR, exp)
    assert verify(sign(t, "k"), "k", address=ADDR, now=exp - 0.5) == t


def test_rejections() -> None:
    signed = sign(UploadToken("i", ADDR, 100.0), "k")
    with pytest.raises(UploadTokenError, match="signature"):
        verify(signed, "other", address=ADDR, now=0)
    with pytest.raises(UploadTokenError, match="expired"):
        verify(signed, "k", address=ADDR, now=100.0)
    with pytest.raises(UploadTokenError, match="issued for"):
        verify(signed, "k", address=ADDR + "y", now=0)
    with pytest.raises(UploadTokenError, match="malformed"):
        verify("garbage", "k", address=ADDR, now=0)
    body, mac = signed.split(".")
    with pytest.raises(UploadTokenError):
        verify(body[:-2] + "AA." + mac, "k", address=ADDR, now=0)

"""Signed, expiring upload tokens for issued addresses (seed 000 proposal 4, seed 002).

A token binds one address to an expiry and is signed with HMAC-SHA256, so a client cannot link
an address it was not issued, nor link one after it expired. Single use is the service's job
(it forgets the token id on link).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

import orjson


class UploadTokenError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class UploadToken:
    token_id: str
    address: str
    expires_at: float


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(token: UploadToken, secret: str) -> str:
    body = orjson.dumps({"id": token.token_id, "a": token.address, "exp": token.expires_at})
    mac = hmac.new(secret.encode(), body, hashlib.sha256).digest()
    return f"{_b64(body)}.{_b64(mac)}"


def verify(signed: str, secret: str, *, address: str, now: float) -> UploadToken:
    """Check signature, address and expiry; raise UploadTokenError saying which failed."""
    try:
        body_b64, mac_b64 = signed.split(".")
        body, mac = _unb64(body_b64), _unb64(mac_b64)
    except ValueError:
        raise UploadTokenError("malformed upload token") from None
    expected = hmac.new(secret.encode(), body, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise UploadTokenError("upload token signature does not match")
    fields = orjson.loads(body)
    token = UploadToken(fields["id"], fields["a"], float(fields["exp"]))
    if token.address != address:
        raise UploadTokenError(f"upload token was issued for {token.address}, not {address}")
    if now >= token.expires_at:
        raise UploadTokenError("upload token expired")
    return token

"""One owner lookup (core.registry.find_owner): the operator commands find an address's
repository in the registry the delete paths check, whatever the address's spelling."""

from __future__ import annotations

from core.registry import owner_of


def test_owner_of_is_the_registered_namespace_containing_the_address() -> None:
    registry = {"s3://b/x/": "a", "s3://b/z/": "c"}
    assert owner_of(registry, "s3://b/x/k") == ("a", "s3://b/x/")
    assert owner_of(registry, "s3://b/xy/k") is None  # a prefix of the name is not inside
    assert owner_of({**registry, "s3://b/x/y/": "d"}, "s3://b/x/y/k") == ("d", "s3://b/x/y/")
    assert owner_of({}, "s3://b/x/k") is None







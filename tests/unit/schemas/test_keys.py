"""Keys no id can escape (issue 19 item 5): repository ids are encoded in Redis keys.

Finding: ids were put into keys unescaped, so an id like ``<victim>}:a:x`` wrote hashes, sets
and sorted sets inside the victim's address prefix, and the victim's reconciler failed on every
run from then on.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from schemas.layout import RepoKeys, key_part

ids = st.text(min_size=1, max_size=60)


@given(ids, ids)
def test_encoded_ids_are_injective_and_never_reach_another_repositorys_keys(a: str,
                                                                            b: str) -> None:
    ka, kb = RepoKeys(a), RepoKeys(b)
    assert (key_part(a) == key_part(b)) == (a == b)
    assert not set(key_part(a)) & set("{}:")
    if a != b:
        # no key of b (all start with b's tag and ':') starts with a's tag and ':'
        assert not (kb.tag + ":").startswith(ka.tag + ":")
        assert not kb.address("s3://x/y").startswith(ka.address_prefix)


def test_ordinary_ids_keep_their_keys() -> None:
    assert RepoKeys("repo-1.a_b").tag == "hd:{repo-1.a_b}"
    assert RepoKeys("victim}:a:x").tag == "hd:{victim%7D%3Aa%3Ax}"



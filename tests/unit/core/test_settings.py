"""Settings: env and TOML, validated at start-up with errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.settings import ConfigError, describe, load_settings


def test_defaults_are_safe() -> None:
    s = load_settings(env={})
    assert s.grace_seconds >= s.min_safe_grace_seconds
    assert s.reaper_batch_keys <= 1000


def test_env_overrides_toml(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text('[hardelete]\nevents_topic = "from-file"\ngrace_seconds = 900\n')
    s = load_settings(cfg, env={"HARDELETE_GRACE_SECONDS": "1200"})
    assert s.events_topic == "from-file"
    assert s.grace_seconds == 1200.0


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"HARDELETE_GRACE_SECONDS": "soon"}, "HARDELETE_GRACE_SECONDS"),
        ({"HARDELETE_TOPIC_PARTITIONS": "0"}, "topic_partitions"),
        ({"HARDELETE_LOG_FORMAT": "xml"}, "log_format"),
        ({"HARDELETE_REDIS_URL": "http://x"}, "redis_url"),
        ({"HARDELETE_REAPER_BATCH_KEYS": "1001"}, "reaper_batch_keys"),
        ({"HARDELETE_ALLOW_UNSAFE_GRACE": "maybe"}, "HARDELETE_ALLOW_UNSAFE_GRACE"),
        ({"HARDELETE_METRICS_PORT": "99999"}, "metrics_port"),
        ({"HARDELETE_PUSHGATEWAY_URL": "gateway:9091"}, "pushgateway_url"),
        ({"HARDELETE_TOPIC_REPLICATION_FACTOR": "0"}, "topic_replication_factor"),
        ({"HARDELETE_GRACE_SECOND": "5"}, "HARDELETE_GRACE_SECOND"),
    ],
)
def test_bad_values_name_the_key(env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(env=env)
    assert err.value.key == key
    assert key in str(err.value)


def test_unsafe_grace_needs_explicit_flag() -> None:
    with pytest.raises(ConfigError, match=r"grace_seconds.*safe minimum"):
        load_settings(env={"HARDELETE_GRACE_SECONDS": "10"})
    s = load_settings(env={"HARDELETE_GRACE_SECONDS": "10", "HARDELETE_ALLOW_UNSAFE_GRACE": "1"})
    assert s.grace_seconds == 10.0


def test_unknown_toml_key_and_missing_file(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text("[hardelete]\ngrace_secs = 1\n")
    with pytest.raises(ConfigError, match=r"grace_secs.*did you mean grace_seconds"):
        load_settings(cfg, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml", env={})


def test_describe_lists_every_env_var() -> None:
    names = [row[0] for row in describe()]
    assert "HARDELETE_KAFKA_BOOTSTRAP" in names and "HARDELETE_GRACE_SECONDS" in names


def test_every_setting_is_documented() -> None:
    from dataclasses import fields

    from core.settings import DOCS, Settings

    assert {f.name for f in fields(Settings)} == set(DOCS)


def test_per_repository_grace(tmp_path: Path) -> None:
    s = load_settings(env={"HARDELETE_REPOSITORY_GRACE": "a=600, b=7200"})
    assert s.grace_for("a") == 600 and s.grace_for("b") == 7200
    assert s.grace_for("other") == s.grace_seconds
    cfg = tmp_path / "g.toml"
    cfg.write_text("[hardelete.repository_grace]\nbig = 86400\n")
    assert load_settings(cfg, env={}).grace_for("big") == 86400
    with pytest.raises(ConfigError) as err:
        load_settings(env={"HARDELETE_REPOSITORY_GRACE": "a=5"})
    assert err.value.key == "repository_grace.a"
    with pytest.raises(ConfigError) as err:
        load_settings(env={"HARDELETE_REPOSITORY_GRACE": "nonsense"})
    assert err.value.key == "repository_grace"
    unsafe = {"HARDELETE_REPOSITORY_GRACE": "a=5", "HARDELETE_ALLOW_UNSAFE_GRACE": "true"}
    assert load_settings(env=unsafe).grace_for("a") == 5

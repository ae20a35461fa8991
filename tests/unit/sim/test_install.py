"""sim/install.py: parallel processes install once; a missing tool is named."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from sim import install


def _build_once(final: str, counter: str) -> None:
    def build(staging: Path) -> None:
        with open(counter, "a") as f:
            f.write("x")
        time.sleep(0.3)  # the others arrive while this one builds
        (staging / "bin").write_text("ok")

    install._install(Path(final), "thing", "instantly", build)


def test_parallel_installers_build_once_and_never_see_a_partial_install(tmp_path: Path) -> None:
    final, counter = tmp_path / "thing-1", tmp_path / "builds"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_build_once, args=(str(final), str(counter)))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert counter.read_text() == "x"
    assert (final / "bin").read_text() == "ok"
    assert sorted(x.name for x in tmp_path.iterdir()) == [".thing-1.lock", "builds", "thing-1"]


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    def build(staging: Path) -> None:
        (staging / "half").write_text("")
        raise install.InstallError("broken")

    with pytest.raises(install.InstallError, match="broken"):
        install._install(tmp_path / "thing-2", "thing", "instantly", build)
    assert [x.name for x in tmp_path.iterdir()] == [".thing-2.lock"]


def test_missing_tools_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    monkeypatch.setenv("HARDELETE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(install.InstallError, match=r"Java 17 or newer.*no `java` is on PATH"):
        install.install_kafka()
    with pytest.raises(install.InstallError, match=r"needs `go`.*HARDELETE_S3_ENDPOINT_URL"):
        install.install_minio()
    with pytest.raises(install.InstallError, match=r"`prometheus` and `promtool`.*apt-get install "
                       r"--no-install-recommends prometheus"):
        install.prometheus_binaries()
    # The launcher says it as its own error (the demo prints it and exits).
    from sim.stack import StackError, kafka_server

    with pytest.raises(StackError, match=r"Java 17 or newer"):
        kafka_server(tmp_path)


def test_the_cache_is_outside_the_tree_and_keyed_by_version(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    monkeypatch.delenv("HARDELETE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert install.cache_dir() == Path("/somewhere/hardelete")
    assert install.kafka_dir().name.startswith(f"kafka-{install.KAFKA_VERSION}-")
    assert install.minio_path() == Path(f"/somewhere/hardelete/minio-{install.MINIO_VERSION}/minio")

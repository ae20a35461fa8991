"""`hardelete reconcile` through the CLI: JSON output, exit codes, user errors in one line."""

from __future__ import annotations

import time

import orjson
import pytest

from hardelete.cli import main
from hardelete.status import explain_address
from sim.model import Model, ModelService
from sim.worlds import World, boundary

pytestmark = [pytest.mark.spark]


@pytest.fixture
def cli_env(settings, monkeypatch):
    monkeypatch.setenv("HARDELETE_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("HARDELETE_S3_ENDPOINT_URL", settings.s3_endpoint_url)
    monkeypatch.setenv("HARDELETE_RECONCILE_MIN_AGE_SECONDS", "0")
    monkeypatch.setenv("HARDELETE_LOG_LEVEL", "error")
    return settings


def test_cli_dry_run_json_then_sweep_only(spark, cli_env, s3, redis_client, capsys):
    clock_start = time.time() - 3600
    model = Model(clock=lambda: clock_start, upload_secret=cli_env.upload_token_secret)
    w = World(cli_env, s3, redis_client, None, model, ModelService(cli_env, s3, None,
                                                                   model=model))  # type: ignore[arg-type]
    w.run([(Model.create_repository, ("cli", "s3://clib/ns/")),
           (Model.write, ("cli", "main", "a", 3)), (Model.leak, ("cli", 5))])
    w.track(None)
    cutoff = boundary() // 1000
    capsys.readouterr()
    code = main(["reconcile", "--repo", "cli", "--dry-run", "--json", "--cutoff", str(cutoff)])
    out = capsys.readouterr().out
    summary = orjson.loads(out)
    assert code == 0 and summary["success"] and summary["mark"]["marked"] == 1
    assert summary["mark"]["categories"]["leaked"]["count"] == 1
    before = w.data("cli")
    assert len(before) == 2
    # As under a Kubernetes CronJob (no scheduler): health is read from the runs' reports, and
    # a dry run deletes nothing, so it is no reconcile yet.
    assert main(["health", "reconciler"]) == 1
    assert "no reconcile run has reported" in capsys.readouterr().out

    code = main(["reconcile", "--repo", "cli", "--sweep-only", summary["run_id"]])
    table = capsys.readouterr().out
    assert code == 0 and "confirmed" in table and "leaked" in table
    assert w.data("cli") == {model.lookup("cli", "main", "a").address}
    assert main(["health", "reconciler"]) == 0
    assert capsys.readouterr().out == "reconciler: healthy\n"
    assert main(["health", "reconciler", "--max-age-hours", "0.0001"]) == 1
    assert f"the last reconcile run of cli ({summary['run_id']}) started" in \
        capsys.readouterr().out

    # `explain` tells why the leaked object went, from the reconciler's own reports.
    (leaked,) = before - w.data("cli")
    ex = explain_address(redis_client, cli_env, leaked, s3=s3)
    assert ex.state == "untracked"
    assert ex.verdict.startswith(f"deleted by the reconciler, run {summary['run_id']} "
                                 "(finished 20"), ex.verdict
    assert "marked leaked" in ex.verdict
    assert any(f"reconciler run {summary['run_id']}: deleted as leaked" in line
               for line in ex.lines), ex.lines
    code = main(["explain", leaked, "--json"])
    assert code == 0 and "deleted as leaked" in capsys.readouterr().out

    # A run id becomes a key: a path segment is refused in one line (MinIO refuses the key
    # with XMinioInvalidObjectName, which used to surface as a raw botocore ClientError).
    for bad in ("../../x", "a/b", ".."):
        assert main(["reconcile", "--repo", "cli", "--sweep-only", bad]) == 2
        err = capsys.readouterr().err
        assert "is not a run id" in err and "Traceback" not in err, err
        assert main(["reports", "show", bad, "--repo", "cli"]) == 2
        err = capsys.readouterr().err
        assert "is not a run id" in err and "Traceback" not in err, err


def test_cli_user_errors_are_one_line(cli_env, capsys):
    assert main(["reconcile", "--repo", "nope", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "hardelete: error:" in err and "unknown to the tracker" in err
    assert "Traceback" not in err
    assert main(["reconcile", "--repo", "x", "--optimized", "--inventory", "/tmp"]) == 2
    assert "do not go together" in capsys.readouterr().err
    assert main(["reconcile", "--repo", "x", "--cutoff", "yesterday"]) == 2
    assert "--cutoff" in capsys.readouterr().err
    # 0 days would count every branch and tag head as expired (issue 33)
    assert main(["reconcile", "--repo", "x", "--expire-older-than-days", "0"]) == 2
    err = capsys.readouterr().err
    assert "--expire-older-than-days must be > 0" in err and "Traceback" not in err, err


def test_cli_all_repositories_dry_run(spark, cli_env, s3, redis_client, capsys):
    clock_start = time.time() - 3600
    model = Model(clock=lambda: clock_start, upload_secret=cli_env.upload_token_secret)
    w = World(cli_env, s3, redis_client, None, model, ModelService(cli_env, s3, None,
                                                                   model=model))  # type: ignore[arg-type]
    w.run([(Model.create_repository, ("one", "s3://allb/one/")), (Model.leak, ("one", 5)),
           (Model.create_repository, ("two", "s3://allb/two/")), (Model.leak, ("two", 5)),
           (Model.leak, ("two", 5))])
    w.track(None)
    cutoff = boundary() // 1000
    capsys.readouterr()
    code = main(["reconcile", "--all", "--dry-run", "--json", "--cutoff", str(cutoff)])
    summaries = orjson.loads(capsys.readouterr().out)
    assert code == 0
    assert [(s["repository"], s["mark"]["marked"]) for s in summaries] == [("one", 1), ("two", 2)]
    assert len(w.data("one")) == 1 and len(w.data("two")) == 2  # a dry run deletes nothing
    assert main(["reconcile", "--all", "--sweep-only", "x"]) == 2
    assert "--all takes no" in capsys.readouterr().err


def test_input_mistakes_are_told_before_spark_starts(cli_env, s3, redis_client, capsys,
                                                     monkeypatch, tmp_path):
    """An unknown or retired repository, a run id with no report, a missing inventory or
    export: one line, and Spark (25 to 40 s of start-up) never started."""
    import reconciler.spark

    def no_spark(*_a: object, **_k: object) -> None:
        raise AssertionError("Spark started before the inputs were checked")

    monkeypatch.setattr(reconciler.spark, "get_spark", no_spark)
    clock_start = time.time() - 3600
    model = Model(clock=lambda: clock_start, upload_secret=cli_env.upload_token_secret)
    w = World(cli_env, s3, redis_client, None, model, ModelService(cli_env, s3, None,
                                                                   model=model))  # type: ignore[arg-type]
    w.run([(Model.create_repository, ("pre", "s3://preb/ns/"))])
    w.track(None)
    for argv, says in [
        (["--repo", "nope", "--dry-run"], "unknown to the tracker"),
        (["--repo", "pre", "--sweep-only", "20260101T000000Z-abcdef"], "no report for run"),
        (["--repo", "pre", "--inventory", str(tmp_path / "missing")], "cannot be read"),
        (["--repo", "pre", "--inventory", str(tmp_path)], "no .parquet or .csv"),
        (["--repo", "pre", "--uncommitted-export", str(tmp_path)], "no export of 'pre'"),
    ]:
        assert main(["reconcile", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and err.count("\n") == 1, err

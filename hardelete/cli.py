"""``hardelete``: one CLI for everything.

Each component owns its subcommand: a module exposing ``configure(parser)`` (adds arguments)
and ``run_cli(settings, args) -> int``. The CLI loads the settings once (env, ``--config``),
sets up logging, and turns user mistakes into one clear line (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from core.errors import UserError
from core.logs import configure_logging
from core.settings import (
    DEFAULT_UPLOAD_TOKEN_SECRET,
    ENV_PREFIX,
    ConfigError,
    Settings,
    load_settings,
    load_with_sources,
)
from hardelete.services import ServiceError, check, describe_error, needs

# (command path, module implementing it, help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("demo",), "sim.demo", "run the model service (and daemons) on the embedded stack"),
    (("soak",), "sim.soak", "a long randomized workload under injected faults, judged by "
                                  "the model's ground truth"),
    (("tracker", "run"), "tracker.daemon", "consume events into Redis reference state"),
    (("reaper", "run"), "reaper.daemon", "hard-delete addresses unreferenced past the grace"),
    (("restore",), "reaper.quarantine", "bring a quarantined address back"),
    (("reconcile",), "reconciler.job", "nightly mark and sweep with retention (PySpark)"),
    (("status",), "hardelete.status", "tracker progress, queues, incidents per repository"),
    (("explain",), "hardelete.status:explain", "why an address is alive or why it was deleted"),
    (("incidents", "list"), "hardelete.incidents:list_",
     "incidents not acknowledged yet (status counts them as needing a person)"),
    (("incidents", "ack"), "hardelete.incidents:ack",
     "acknowledge the incidents looked at (recorded with who and why)"),
    (("fail-closed",), "hardelete.failclosed",
     "list repositories whose mirror is unproven, or lift the flag (recorded)"),
    (("rebuild", "prepare"), "hardelete.failclosed:prepare_",
     "snapshot a fail-closed repository's mirror; print the nonce its state export needs"),
    (("rebuild", "apply"), "hardelete.failclosed:apply_",
     "rebuild a fail-closed repository from its service's state export; lift the flag"),
    (("config",), "hardelete.cli:config", "show the effective settings"),
    (("hold", "add"), "hardelete.holds:add", "hold an address or prefix: no delete path takes it"),
    (("hold", "remove"), "hardelete.holds:remove", "lift a hold"),
    (("hold", "list"), "hardelete.holds:list_", "the holds of one or every repository"),
    (("dlq", "list"), "hardelete.dlq:list_", "dead-lettered events, with their reasons"),
    (("dlq", "show"), "hardelete.dlq:show", "one dead-lettered event in full"),
    (("dlq", "replay"), "hardelete.dlq:replay", "publish a fixed event to the events topic"),
    (("dlq", "resolve"), "hardelete.dlq:resolve_",
     "lift the holds a dead-lettered event put on its addresses"),
    (("quarantine", "list"), "reaper.quarantine_ops:list_", "quarantined objects of a repository"),
    (("quarantine", "purge"), "reaper.quarantine_ops:purge",
     "delete quarantined objects whose keep period is over"),
    (("retired", "list"), "reconciler.retirement:list_",
     "retired repositories, how long their data is kept, purges"),
    (("retired", "purge"), "reconciler.retirement:purge",
     "purge a retired repository's data once its retention is over (reported)"),
    (("reports", "list"), "hardelete.reports:list_", "past reconciler runs of a repository"),
    (("reports", "show"), "hardelete.reports:show", "one reconciler run's summary"),
    (("facts", "list"), "hardelete.facts:list_",
     "a repository's durable facts (holds, pauses) and whether each verifies"),
    (("facts", "reseal"), "hardelete.facts:reseal",
     "sign a repository's durable facts anew under the current key, once judged"),
    (("pause",), "hardelete.pause:pause", "stop the reaper and the sweep for one repository"),
    (("resume",), "hardelete.pause:resume", "let the reaper and the sweep act again"),
    (("health",), "hardelete.health", "exit 0 when a daemon is healthy (probes, healthchecks)"),
    (("schedule",), "hardelete.schedule",
     "run the reconciler daily, catching up a missed run, failures surfaced"),
]


class _Config:
    """`hardelete config`: the effective settings (secrets masked), each with its environment
    variable and where its value came from (default, file, env)."""

    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        import dataclasses

        import orjson

        _, sources = load_with_sources(args.config)
        rows = []
        for k, v in dataclasses.asdict(settings).items():
            shown = "***" if "secret" in k and v else v
            rows.append({"setting": k, "env": ENV_PREFIX + k.upper(), "value": shown,
                         "source": sources.get(k, "default")})
        if args.json:
            print(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        else:
            for row in rows:
                print(f"{row['env']:40} {row['value']!r:40} {row['source']}")
        if settings.upload_token_secret == DEFAULT_UPLOAD_TOKEN_SECRET:
            print("hardelete: warning: HARDELETE_UPLOAD_TOKEN_SECRET is the built-in default; "
                  "set a secret of your own before real use", file=sys.stderr)
        return 0


def non_negative(text: str) -> int:
    """argparse type for counts such as --limit: an integer >= 0."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {n}")
    return n


config = _Config


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hardelete")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _load(target: str) -> ModuleType | type:
    # Every command's module ships in this distribution: a missing one is a bug, not an option.
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def build_parser() -> tuple[argparse.ArgumentParser, dict[tuple[str, ...], object]]:
    parser = argparse.ArgumentParser(prog="hardelete", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="TOML settings file (else $HARDELETE_CONFIG)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    impls: dict[tuple[str, ...], object] = {}
    for path, target, help_text in COMMANDS:
        impl = _load(target)
        subs = top
        if len(path) == 2:
            if path[0] not in groups:
                grp = top.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = grp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
            subs = groups[path[0]]
        sub = subs.add_parser(path[-1], help=help_text, description=help_text)
        sub.set_defaults(_path=path)
        impl.configure(sub)  # type: ignore[union-attr]
        impls[path] = impl
    return parser, impls


def main(argv: Sequence[str] | None = None) -> int:
    import os

    if not sys.stdout.isatty():  # piped: rich would cut tables at 80 columns
        os.environ.setdefault("COLUMNS", "1000")
    parser, impls = build_parser()
    args = parser.parse_args(argv)
    path = getattr(args, "_path", None)
    if path is None:
        parser.print_help()
        return 2
    settings: Settings | None = None
    try:
        settings = load_settings(args.config)
        configure_logging(settings.log_format, settings.log_level)
        check(settings, needs(path, args, impls[path]))
        code: int = impls[path].run_cli(settings, args)  # type: ignore[attr-defined]
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except (ConfigError, UserError, ServiceError) as exc:
        print(f"hardelete: error: {exc}", file=sys.stderr)
        return 2 if not isinstance(exc, ServiceError) else 3
    except KeyboardInterrupt:
        print("hardelete: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hardelete ... | head`: the reader has gone, nothing to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as exc:
        line = describe_error(exc, settings)
        if line is None:
            raise
        print(f"hardelete: error: {line}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())

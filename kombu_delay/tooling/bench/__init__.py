"""``kombu-delay bench``: measure publish rate, precision, bursts, memory, thaws, Redis CPU, backpressure,
scale and herds.

It starts a private redis-server (or uses ``--broker``, whose database it
flushes), publishes Celery's own messages, runs real mover processes, prints a
table with the project's targets, writes the results as JSON, and draws charts
(in the terminal, and as a PNG with the ``plot`` extra).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import celery
import click
import kombu
import redis

from kombu_delay import __version__
from kombu_delay.cli.common import forget_celery_servers
from kombu_delay.config import Settings
from kombu_delay.connect import Target, delay_url
from kombu_delay.errors import needs_extra
from kombu_delay.store import Store
from kombu_delay.tooling.bench import report as bench_report
from kombu_delay.tooling.bench.env import Movers, Payloads, Probe
from kombu_delay.tooling.bench.scenarios import SCENARIOS, Ctx, Sizes
from kombu_delay.tooling.redis_server import RedisServer
from kombu_delay.tooling.stopping import terminated_as_interrupted

Scenario = Callable[[Ctx], dict[str, Any]]


def scenarios(with_e2e: bool, with_drain: bool = False) -> dict[str, Scenario]:
    """Every scenario in run order; ``inspect`` when its module is installed, ``web`` with the
    web extra; ``e2e`` and ``drain`` (real workers, minutes) only when asked for."""
    found: dict[str, Scenario] = dict(SCENARIOS)
    try:
        inspect_mod = importlib.import_module("kombu_delay.tooling.bench.inspect")
    except ImportError:
        inspect_mod = None
    if inspect_mod is not None and hasattr(inspect_mod, "run"):
        found["inspect"] = inspect_mod.run
    if importlib.util.find_spec("flask") is not None:  # the dashboard, with the web extra
        found["web"] = importlib.import_module("kombu_delay.tooling.bench.web").run
    if with_e2e:
        from kombu_delay.tooling.bench.e2e import e2e

        found["e2e"] = e2e
    if with_drain:
        from kombu_delay.tooling.bench.drain import drain

        found["drain"] = drain
    return found


def _plain_url(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme.removeprefix('delay')}{sep}{rest}"


#: The size options whose field in :class:`Sizes` is not their name without its ``n_``.
_SIZE_FIELDS = {"precision_window": "precision_window_s", "herd_short_ahead": "herd_short_ahead_s"}


@click.command()
@click.option(
    "--broker", default=None, help="Use this Redis (its database is FLUSHED) instead of a private one."
)
@click.option(
    "--only",
    default="",
    help="Comma-separated scenarios (publish,precision,burst,memory,thaw,cpu,backpressure,scale,herd,"
    "e2e,inspect,web,drain).",
)
@click.option(
    "--e2e", "with_e2e", is_flag=True, help="Also run the end-to-end scenario with stock Celery workers."
)
@click.option(
    "--json-out", default="bench-results/bench.json", show_default=True, type=click.Path(path_type=Path)
)
@click.option(
    "--plot-out", default="bench-results/bench.png", show_default=True, type=click.Path(path_type=Path)
)
@click.option(
    "--payload-bytes", default=1024, show_default=True, help="Approximate size of each Celery message."
)
@click.option("--batch-size", default=500, show_default=True, help="The movers' --batch-size.")
@click.option("--publish", "n_publish", default=Sizes.publish, show_default=True, help="Messages per side.")
@click.option("--precision", "n_precision", default=Sizes.precision, show_default=True)
@click.option("--precision-window", default=Sizes.precision_window_s, show_default=True, help="Seconds.")
@click.option("--burst", "n_burst", default=Sizes.burst, show_default=True)
@click.option("--memory", "n_memory", default=Sizes.memory, show_default=True)
@click.option("--thaw", "n_thaw", default=Sizes.thaw, show_default=True, help="Messages stored compressed.")
@click.option("--scale-small", default=Sizes.scale_small, show_default=True)
@click.option("--scale-large", default=Sizes.scale_large, show_default=True)
@click.option("--scale-probe", default=Sizes.scale_probe, show_default=True, help="Messages timed per round.")
@click.option(
    "--scale-rounds",
    type=click.IntRange(min=1),
    default=Sizes.scale_rounds,
    show_default=True,
    help="Rounds per size; each figure is their median.",
)
@click.option(
    "--scale-layout",
    type=click.Choice(["spread", "one-set"]),
    default=Sizes.scale_layout,
    show_default=True,
    help="Due over 90 days with the default settings, or all in one sorted set (the worst case).",
)
@click.option(
    "--scale-middle", default=Sizes.scale_middle, show_default=True, help="A third size (memory per msg)."
)
@click.option("--cpu", "n_cpu", default=Sizes.cpu, show_default=True, help="Messages per side.")
@click.option("--backpressure", "n_backpressure", default=Sizes.backpressure, show_default=True)
@click.option("--backpressure-rate", default=Sizes.backpressure_rate, show_default=True, help="--max-rate.")
@click.option(
    "--backpressure-max-len",
    default=Sizes.backpressure_max_len,
    show_default=True,
    help="--max-queue-length.",
)
@click.option(
    "--backpressure-consume-rate",
    default=Sizes.backpressure_consume_rate,
    show_default=True,
    help="Consumer msgs/s.",
)
@click.option(
    "--herd", "n_herd", default=Sizes.herd, show_default=True, help="Compressed, due at one instant."
)
@click.option("--herd-short", default=Sizes.herd_short, show_default=True, help="The same, short thaw-ahead.")
@click.option("--herd-short-ahead", default=Sizes.herd_short_ahead_s, show_default=True, help="Seconds.")
@click.option("--herd-movers", default=Sizes.herd_movers, show_default=True)
@click.option("--e2e-tasks", default=Sizes.e2e_tasks, show_default=True, help="Tasks pending per worker.")
@click.option(
    "--e2e-precision", default=Sizes.e2e_precision, show_default=True, help="Tasks timed end to end."
)
@click.option("--drain", "n_drain", default=Sizes.drain, show_default=True, help="Herd run by one worker.")
@click.option("--drain-procs", default=Sizes.drain_procs, show_default=True, help="That worker's processes.")
@click.option(
    "--drain-look-ahead", default=Sizes.drain_look_ahead, show_default=True, help="Look-aheads to run, s."
)
@click.option(
    "--drain-prefetch", default=Sizes.drain_prefetch, show_default=True, help="Its --prefetch-multiplier."
)
@click.option("--drain-variants", default="", help="Only these drain variants (and stock); default all.")
def bench(
    broker: str | None,
    only: str,
    with_e2e: bool,
    json_out: Path,
    plot_out: Path,
    payload_bytes: int,
    batch_size: int,
    **size_options: Any,
) -> None:
    """Benchmark kombu-delay on this machine and check the project's targets.

    A full run at the default sizes takes about half an hour (the herd of a
    million compressed messages, ten minutes); --e2e adds stock Celery
    workers. The group's --broker is not used, nor the KOMBU_DELAY_* variables
    (the figures are those of the defaults), and --prefix and -o are refused:
    without this command's own --broker, a private redis-server is started.

    \b
    Examples:
      kombu-delay bench
      kombu-delay bench --only precision,burst --burst 50000
      kombu-delay bench --only herd,cpu
      kombu-delay bench --only scale --scale-middle 1000000 --scale-large 10000000
      kombu-delay bench --e2e --json-out results.json
      kombu-delay bench --only drain --drain 20000   # stock vs kombu-delay workers
      kombu-delay bench --broker redis://127.0.0.1:7000/5   # FLUSHES db 5
    """
    target = click.get_current_context().find_object(Target)
    if target is not None and target.transport_options:  # --prefix or -o, before or after "bench"
        raise click.UsageError(
            "bench does not take --prefix or -o: it measures the default settings, on its own "
            "Redis (or its own --broker)"
        )
    ignored = forget_celery_servers()  # Celery reads them before an app's own broker= argument
    # The movers it starts read these: a KOMBU_DELAY_MAX_RATE=2 made the precision's p99 6 s.
    ignored += [
        name
        for name in sorted(os.environ)
        if name.startswith("KOMBU_DELAY_") and not name.startswith("KOMBU_DELAY_BENCH_")
    ]
    for name in ignored:
        os.environ.pop(name, None)
    if ignored:
        click.echo(
            f"bench: ignoring {', '.join(ignored)}: it measures the Redis it was given, with the defaults",
            err=True,
        )
    available = scenarios(with_e2e or "e2e" in only.split(","), "drain" in only.split(","))
    chosen = [name.strip() for name in only.split(",") if name.strip()] or list(available)
    unknown = [name for name in chosen if name not in available]
    if unknown:
        raise click.UsageError(f"unknown scenario(s) {unknown}; known: {sorted(available)}")
    sizes = Sizes(**{_SIZE_FIELDS.get(k, k.removeprefix("n_")): v for k, v in size_options.items()})
    try:
        with terminated_as_interrupted():  # SIGTERM and SIGHUP stop it as Ctrl-C does
            results, errors, meta = _run(broker, chosen, available, sizes, batch_size, payload_bytes)
    except KeyboardInterrupt:  # before the first scenario, or while stopping
        _interrupted("")
    if meta.get("interrupted"):
        _write_json(results, errors, meta, json_out)
        _interrupted(f" during {meta['interrupted']}; what it measured before is in {json_out}")
    _report(results, errors, meta, json_out, plot_out)
    if errors:
        raise click.ClickException(f"scenario(s) failed: {', '.join(errors)}")
    # A message lost, doubled or early is no slow figure: the run fails on it, as a test would.
    missed = [
        f"{row['scenario']}: {row['metric']}"
        for row in bench_report.evaluate(results)
        if row["target"] == "= 0" and row["met"] is False
    ]
    if missed:
        raise click.ClickException(f"counts that must be none were not: {'; '.join(missed)}")


def _run(
    broker: str | None,
    chosen: list[str],
    available: dict[str, Scenario],
    sizes: Sizes,
    batch_size: int,
    payload_bytes: int,
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """Run the ``chosen`` scenarios against ``broker`` (else a private Redis); return their
    results, the errors of those that failed, and the run's machine and versions."""
    # Stopped by Linux too if the bench is killed outright; outside the bench's process group, so
    # that Ctrl-C reaches the bench only, which stops it once it has read what it measured.
    server = None if broker else RedisServer(dies_with_parent=True, own_session=True).start()
    url = _plain_url(broker) if broker else server.url  # type: ignore[union-attr]
    probe = Probe(url)
    workdir = tempfile.TemporaryDirectory(prefix="kombu-delay-bench-")
    movers = Movers(delay_url(url), batch_size, Path(workdir.name))
    started, started_at = time.monotonic(), datetime.now(UTC)
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    interrupted = ""
    # The slow log's settings are the server's, for every database: a --broker run puts them back.
    slowlog = probe.slowlog_settings()
    try:
        probe.flush()
        ctx = Ctx(
            url=url,
            delay_url=delay_url(url),
            probe=probe,
            store=Store(probe.client),
            payloads=Payloads(probe, url, payload_bytes),
            movers=movers,
            sizes=sizes,
            settings=Settings(),
        )
        for name in chosen:
            click.echo(f"-- {name} ...", err=True)
            begun = time.monotonic()
            try:
                results[name] = available[name](ctx)
                if results[name].get("failed"):  # it ran to its end, and reports what went wrong
                    errors[name] = str(results[name]["failed"])
            except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP: stop everything, keep what was measured
                interrupted = name
                threading.excepthook = _quiet  # a reader of the Redis about to stop need not say so
                break
            except Exception as exc:  # one failed scenario must not hide the others
                errors[name] = f"{exc.__class__.__name__}: {exc}"
                click.echo(traceback.format_exc(), err=True)
            finally:
                movers.stop_all()
            click.echo(f"   {name} took {time.monotonic() - begun:.1f} s", err=True)
        meta = {
            "started": started_at.isoformat(timespec="seconds"),
            "duration_s": round(time.monotonic() - started, 1),
            "nproc": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "redis": probe.redis_version(),
            "kombu": kombu.__version__,
            "celery": celery.__version__,
            "kombu_delay": __version__,
            "batch_size": batch_size,
            "sizes": vars(sizes),
            "interrupted": interrupted,
        }
    finally:
        movers.stop_all()
        if server is None:  # (the database given is the bench's: it leaves it empty)
            with contextlib.suppress(redis.RedisError):
                probe.set_settings(slowlog)
                probe.flush()
        probe.close()
        if server is not None:
            server.cleanup()
        workdir.cleanup()
    return results, errors, meta


def _quiet(args: threading.ExceptHookArgs) -> None:
    """A thread's exception, left unsaid: the run is being stopped."""


def _interrupted(where: str) -> NoReturn:
    click.echo(f"bench: interrupted{where}; every process it started is stopped", err=True)
    sys.exit(130)


def _write_json(
    results: dict[str, Any], errors: dict[str, str], meta: dict[str, Any], json_out: Path
) -> None:
    """Write the results, the errors, the run's machine and versions, and the targets table."""
    rows = bench_report.evaluate(results)
    report = {"meta": meta, "results": results, "errors": errors, "targets": rows}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    # A figure not measured (NaN) is null: JSON has no NaN, and strict readers refuse it.
    json_out.write_text(json.dumps(_finite(report), indent=1, default=str, allow_nan=False))


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite made ``None``, in its lists and dicts too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _report(
    results: dict[str, Any], errors: dict[str, str], meta: dict[str, Any], json_out: Path, plot_out: Path
) -> None:
    """Print the targets table and the charts, and write the JSON (and the PNG if it can)."""
    _write_json(results, errors, meta, json_out)
    rows = bench_report.evaluate(results)
    click.echo(bench_report.table(rows))
    click.echo("\n" + bench_report.terminal_charts(results))
    if bench_report.plot(results, plot_out):
        click.echo(f"\nplot: {plot_out}")
    else:
        click.echo(f"\n(no PNG: {needs_extra('a PNG', 'plot')})")
    click.echo(
        f"\nresults: {json_out}  ({meta['duration_s']} s, Redis {meta['redis']}, {meta['nproc']} cores)"
    )

"""The Lua library: each script carries its header and exactly the helpers it includes, every
include resolves, the scripts are shipped as package data, and Redis compiles each one."""

from __future__ import annotations

import configparser
import fnmatch
import re
from importlib import resources

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.message import Due
from kombu_delay.store import Store, keys, scripts, spaces
from kombu_delay.store.replies import Scheduled
from tests.support.procs import ROOT
from tests.support.stored import kombu_payload, redis_ms

LUA = resources.files("kombu_delay.store").joinpath("lua")
DEFINED = re.compile(r"^local function ([a-z_]+)\(", re.M)


def lua_files() -> list[str]:
    return sorted(f.name for f in LUA.iterdir() if f.name.endswith(".lua"))


def helpers() -> dict[str, str]:
    """Every helper function -> the helper file that defines it."""
    found: dict[str, str] = {}
    for name in lua_files():
        if name.startswith("_"):
            for fn in DEFINED.findall(LUA.joinpath(name).read_text("utf-8")):
                assert fn not in found, f"{fn} is defined in {found.get(fn)} and {name}"
                found[fn] = name
    return found


def test_every_lua_file_is_package_data() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    patterns = config["options.package_data"]["kombu_delay.store"].split()
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "kombu_delay/store/lua/*.lua" in manifest
    for name in lua_files():
        assert any(fnmatch.fnmatch(f"lua/{name}", p) for p in patterns), name


@pytest.mark.parametrize("name", scripts.names())
def test_a_script_has_its_header_and_every_helper_it_calls(name: str) -> None:
    text = scripts.source(name)
    assert not re.search(r"^--- @include", text, re.M), "an include was left unresolved"
    head = text.split("]]", 1)[0]
    assert head.startswith(f"--[[ {name}: ")
    for part in ("KEYS[1]", "Returns:", "Bound:"):
        if part != "KEYS[1]" or "KEYS[" in text.split("]]", 1)[1]:
            assert part in head, (name, part)
    # A helper is defined once, before its first call; each helper file included is used.
    body = re.sub(r"--[^\n]*", "", re.sub(r"--\[\[.*?\]\]", "", text, flags=re.S))
    used: set[str] = set()
    for fn, where in helpers().items():
        calls = [m.start() for m in re.finditer(rf"(?<![\w.:])(?<!function ){fn}\(", body)]
        defs = [m.start() for m in re.finditer(rf"^local function {fn}\(", body, re.M)]
        if calls:
            assert len(defs) == 1, f"{name} calls {fn} ({where}) but defines it {len(defs)} times"
            assert defs[0] < min(calls), (name, fn)
            used.add(where)
    own = scripts._read(name)
    for helper in re.findall(r"^--- @include ([a-z_]+)$", own, re.M):
        assert f"_{helper}.lua" in used, f"{name} includes {helper} and calls none of it"


def test_a_script_that_reads_the_clock_takes_now_ms() -> None:
    for name in scripts.names():
        text = scripts.source(name)
        if "clock(ARGV" in text:
            head = text.split("]]", 1)[0]
            assert re.search(r"ARGV\[\d+\] now_ms +epoch ms .*'' = Redis TIME", head), name


def test_an_unknown_include_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = scripts._read
    fake = {"x": "--- @include nowhere\n"}
    monkeypatch.setattr(scripts, "_read", lambda name: fake.get(name) or real(name))
    with pytest.raises(FileNotFoundError):
        scripts.source.__wrapped__("x")


def test_a_constant_comes_from_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--- @const`` lines stand for the integers of keys.py: one definition, no argument."""
    assert "local FORMAT = 1\n" in scripts.source("schedule")
    assert "local MAX_DUE_MS, FUTURE_BEAT_MS = 4398046511103, 60000\n" in scripts.source("schedule")
    assert (keys.FORMAT, keys.MAX_DUE_MS) == (1, 4398046511103)
    real = scripts._read
    fake = {"x": "--- @const NAMESPACE\n"}
    monkeypatch.setattr(scripts, "_read", lambda name: fake.get(name) or real(name))
    with pytest.raises(TypeError, match="NAMESPACE"):
        scripts.source.__wrapped__("x")


def test_redis_compiles_every_script(r: redis.Redis) -> None:
    for name in scripts.names():
        sha = r.script_load(scripts.source(name))
        assert r.script_exists(sha) == [True], name


def test_a_publish_sends_only_the_arguments_it_needs(r: redis.Redis, prefix: str) -> None:
    """schedule.lua's optional arguments: each costs Redis work in every call, so those after
    the last one needed are left out, and the script reads an absent one as its default."""
    store, settings, due = Store(r, prefix), Settings(compress_after_ms=0), redis_ms(r)
    plain = Due(due, task_id="a")  # due now: judged by Redis's clock (see test_clock.py)
    call_keys, args = store._schedule_call(spaces.ORDINARY, plain, f"{prefix}q", "{}", settings)
    assert call_keys == [f"{prefix}q"]
    assert len(args) == 6
    _, args = store._schedule_call(spaces.ORDINARY, plain, f"{prefix}q", "{}", settings, expires_ms=5000)
    assert args[6:] == ["", 0, 0, 0, 0, 0, 5000]
    # Stored as with every argument given: a relative due, and the queue's x-expires.
    store.schedule(Due(120_000, relative=True, task_id="b"), f"{prefix}q", kombu_payload("b"), settings, 5000)
    [meta] = r.keys(f"{keys.ns(prefix)}m:*")
    assert r.hget(meta, f"e:{prefix}q") == b"5000"
    [found] = store.find("b")
    assert due + 120_000 - 1000 <= found.score < due + 120_000 + 5000


def test_a_stored_publish_gets_the_short_reply_and_the_rest_the_whole_one(
    r: redis.Redis, prefix: str
) -> None:
    """schedule.lua answers a message stored for the due time it was given with 1 alone (a
    table costs Redis more to send); a relative delay, a count of movers asked for, and every
    other outcome get the whole reply, with the due time and the clock."""
    store, settings, queue, now = Store(r, prefix), Settings(compress_after_ms=0), f"{prefix}q", redis_ms(r)
    script = store._scripts["schedule"]

    def reply(due: Due, **options: int) -> object:
        return script(
            *store._schedule_call(
                spaces.ORDINARY, due, queue, kombu_payload(due.task_id), settings, **options
            )
        )

    assert reply(Due(now + 60_000, task_id="a")) == 1
    whole = reply(Due(60_000, relative=True, task_id="b"))
    assert isinstance(whole, list) and whole[0] == 1 and whole[1] >= now + 60_000
    counted = reply(Due(now + 60_000, task_id="d"), movers_fresh_ms=30_000)
    assert isinstance(counted, list) and counted[3] == 0
    assert isinstance(reply(Due(now - 1, task_id="e")), list)  # pushed now
    result = store.schedule(Due(now + 60_000, task_id="f"), queue, kombu_payload("f"), settings)
    assert (result.outcome, result.due_ms, result.now_ms) == (Scheduled.STORED, now + 60_000, None)
    assert r.llen(queue) == 1 and store.pending([queue]) == 4


def test_a_process_runs_the_scripts_it_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    # An upgrade in place writes new Lua files under a running mover, which read each file when
    # it first used it: a thaw first run after the upgrade ran new Lua with the old arguments.
    folder = resources.files(scripts.__package__).joinpath("lua")
    on_disk = {
        f.name.removesuffix(".lua"): f.read_text("utf-8") for f in folder.iterdir() if f.name.endswith(".lua")
    }
    assert on_disk == scripts._TEXTS
    monkeypatch.setattr(
        scripts.resources, "files", lambda *_: pytest.fail("a script read from disk after import")
    )
    assert "ARGV[4] past" in scripts.source.__wrapped__("thaw")


def test_a_script_flushed_between_its_reload_and_its_call_is_called_again(
    r: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # redis-py loads a script again after NOSCRIPT, once: a SCRIPT FLUSH between that load and
    # its EVALSHA (an operator's, in a loop) failed the call, a publish or a move, with redis-py's
    # own NoScriptError. The call ran nothing then, so it is made again.
    store = Store(r, prefix)
    load, flushes = r.script_load, [2]

    def load_then_flush(text: str) -> str:
        sha = load(text)
        if flushes[0]:
            flushes[0] -= 1
            r.script_flush()
        return sha

    r.script_flush()
    monkeypatch.setattr(r, "script_load", load_then_flush)
    store.count("tried", 2)  # count.lua: a script, not a function

    assert flushes == [0] and r.hget(keys.totals(prefix), "tried") == b"2"

"""A publish's script as a Redis 7 function (``FCALL``): it stores exactly what the script
stores, the library comes back after the server lost it, and where functions are missing
(Redis 6) or refused (an ACL without them) the script runs as it is, by ``EVALSHA``."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.errors import DelayTooLong, RedisRefused, translated_errors
from kombu_delay.message import Due
from kombu_delay.store import Store, scripts
from kombu_delay.tooling.redis_server import RedisServer
from tests.support.servers import binary_before
from tests.support.stored import calls, kombu_payload

NOW = 1_800_000_000_000
DEST = "celery"


def pairs(flat: list[Any]) -> dict[bytes, Any]:
    """A RESP2 map (a flat list of names and values) as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def publish_all(store: Store) -> list[Any]:
    """Publishes of every kind, at a fixed clock: stored, the same again, due now, relative,
    with the queue's x-expires and a movers count, compressed, and beyond max_delay."""
    settings = Settings(compress_after_ms=3_600_000, max_delay_ms=86_400_000)
    replies: list[Any] = []
    for due, task_id, extra in (
        (Due(NOW + 60_000, task_id="a"), "a", {}),
        (Due(NOW + 60_000, task_id="a"), "a", {}),  # the same payload: a duplicate
        (Due(NOW - 1, task_id="b"), "b", {}),  # due: pushed
        (Due(30_000, relative=True, task_id="c"), "c", {"expires_ms": 9000, "movers_fresh_ms": 30_000}),
        (Due(NOW + 30_000, task_id="d"), "d", {}),  # earlier than "a": the first of its set
        (Due(NOW + 7_200_000, task_id="e"), "e", {}),  # compressed
    ):
        replies.append(store.schedule(due, DEST, kombu_payload(task_id), settings, now_ms=NOW, **extra))
    with pytest.raises(DelayTooLong):
        store.schedule(Due(NOW + 172_800_000, task_id="f"), DEST, kombu_payload("f"), settings, now_ms=NOW)
    return replies


def dump(r: redis.Redis) -> dict[bytes, Any]:
    """Every key with its value and its expiry time."""
    found: dict[bytes, Any] = {}
    for key in sorted(r.keys("*")):
        kind = r.type(key)
        value: Any = {
            b"zset": lambda k: r.zrange(k, 0, -1, withscores=True),
            b"hash": r.hgetall,
            b"list": lambda k: r.lrange(k, 0, -1),
            b"string": r.get,
        }[kind](key)
        found[key] = (kind, value, r.execute_command("PEXPIRETIME", key))
    return found


def publish_over_damaged_times(store: Store, r: redis.Redis) -> list[Any]:
    """Publishes into one bucket whose end and expiry (meta fields read as times) are
    rewritten by hand between them, as text no script writes, some of it twice: a function
    keeps the times it read (a memo by their text) and must read those as none each time."""
    settings = Settings(compress_after_ms=0)
    replies = []
    meta = f"{store.ns}m:{NOW + 60_000 - (NOW + 60_000) % 60_000}"
    for i, (end, x) in enumerate(
        (("inf", "nan"), ("inf", "1.5"), ("1e20", "inf"), (None, None), ("inf", "nan"))
    ):
        if end is not None:
            r.hset(meta, mapping={"end": end, "x": x})
        task_id = f"t{i}"
        replies.append(
            store.schedule(
                Due(NOW + 60_000 + i, task_id=task_id), DEST, kombu_payload(task_id), settings, now_ms=NOW
            )
        )
    return replies


def test_a_function_reads_damaged_times_as_the_script_does(
    r7: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_function = publish_over_damaged_times(Store(r7, "app:"), r7)
    assert calls(r7, "fcall") == 5
    stored = dump(r7)
    r7.flushall()
    r7.function_flush()
    monkeypatch.setattr(scripts, "FUNCTIONS", ())
    as_script = publish_over_damaged_times(Store(r7, "app:"), r7)
    assert calls(r7, "evalsha") >= 5
    assert as_script == as_function
    assert dump(r7) == stored


def test_a_publish_runs_as_a_function_and_stores_what_the_script_stores(
    r7: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_function = publish_all(Store(r7, "app:"))
    # The last one writes nothing; the one EVALSHA is the publisher's ACL ask (publish_allowed.lua).
    assert calls(r7, "fcall") == 7 and calls(r7, "evalsha", succeeded=True) == 1
    stored = dump(r7)
    assert stored[DEST.encode()][1] == [kombu_payload("b").encode()]
    r7.flushall()
    monkeypatch.setattr(scripts, "FUNCTIONS", ())
    as_script = publish_all(Store(r7, "app:"))
    assert calls(r7, "evalsha") >= 7
    assert as_script == as_function
    assert dump(r7) == stored


def publish_spread(r: redis.Redis) -> list[Any]:
    """300 publishes over 150 buckets, which two namespaces share, two destinations and both
    spaces: more names than a function keeps (put_names in _put.lua), each asked again."""
    settings = Settings(compress_after_ms=3_600_000)
    replies: list[Any] = []
    for n in range(300):
        store = Store(r, ("app:", "other:")[n // 150])
        ahead = 60_000 * (n % 150) + (7_200_000 if n % 3 == 0 else 60_000)
        due = Due(NOW + ahead, task_id=f"t{n}")
        replies.append(
            store.schedule(due, (DEST, "other")[n % 4 // 2], kombu_payload(f"t{n}"), settings, now_ms=NOW)
        )
    return replies


def test_a_function_keeps_the_names_of_many_buckets_and_stores_what_the_script_stores(
    r7: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_function = publish_spread(r7)
    # A Store each: each asks the ACL once (publish_allowed.lua), by EVALSHA.
    assert calls(r7, "fcall") == 300 and calls(r7, "evalsha", succeeded=True) == 300
    stored = dump(r7)
    r7.flushall()
    monkeypatch.setattr(scripts, "FUNCTIONS", ())
    as_script = publish_spread(r7)
    assert as_script == as_function
    assert dump(r7) == stored


def test_the_library_is_one_per_version_and_loads_once(r7: redis.Redis) -> None:
    name, text = scripts.library()
    assert name.startswith("kombu_delay_") and text.startswith(f"#!lua name={name}\n")
    Store(r7, "").schedule(Due(NOW + 60_000, task_id="a"), DEST, kombu_payload("a"), Settings(), now_ms=NOW)
    [library] = [pairs(entry) for entry in r7.function_list()]
    assert library[b"library_name"].decode() == name
    assert [pairs(f)[b"name"].decode() for f in library[b"functions"]] == [f"{name}_schedule"]
    # A second publisher finds it there ("already exists"), and runs it.
    Store(r7, "").schedule(Due(NOW + 60_000, task_id="b"), DEST, kombu_payload("b"), Settings(), now_ms=NOW)
    assert calls(r7, "function|load") == 2 and calls(r7, "fcall") == 2
    assert len(r7.function_list()) == 1


def test_a_library_the_server_lost_is_loaded_again(r7: redis.Redis) -> None:
    """FUNCTION FLUSH (or a restart that kept no data): the next publish still stores its
    message, by the script, and the one after runs the function again."""
    store = Store(r7, "")
    for task_id in ("a", "b", "c"):
        if task_id == "b":
            r7.function_flush()
        store.schedule(
            Due(NOW + 60_000, task_id=task_id), DEST, kombu_payload(task_id), Settings(), now_ms=NOW
        )
    assert all(store.find(task_id) for task_id in ("a", "b", "c"))
    assert calls(r7, "fcall") == 3  # a; b's, not found; c
    assert calls(r7, "function|load") == 2
    assert r7.function_list()


def test_an_acl_without_functions_publishes_by_evalsha(r7: redis.Redis) -> None:
    r7.execute_command("ACL", "SETUSER", "publisher", "on", ">pw", "~*", "&*", "+@all", "-fcall", "-function")
    user = redis.Redis(port=r7.connection_pool.connection_kwargs["port"], username="publisher", password="pw")
    store = Store(user, "")
    for task_id in ("a", "b"):
        store.schedule(
            Due(NOW + 60_000, task_id=task_id), DEST, kombu_payload(task_id), Settings(), now_ms=NOW
        )
    assert store.find("a") and store.find("b")
    assert calls(r7, "evalsha") >= 2 and calls(r7, "fcall") == 0
    # Asked once: the refusal is not repeated on every publish.
    assert int(r7.info("commandstats")["cmdstat_function|load"]["rejected_calls"]) == 1
    user.close()


def test_a_function_refused_under_maxmemory_is_a_refusal_that_writes_nothing(r7: redis.Redis) -> None:
    store = Store(r7, "")
    store.schedule(Due(NOW + 60_000, task_id="a"), DEST, kombu_payload("a"), Settings(), now_ms=NOW)
    before = dump(r7)
    r7.config_set("maxmemory", 1)
    try:
        with pytest.raises(RedisRefused, match="maxmemory"):
            store.schedule(Due(NOW + 60_000, task_id="b"), DEST, kombu_payload("b"), Settings(), now_ms=NOW)
    finally:
        r7.config_set("maxmemory", 0)
    assert dump(r7) == before


def test_redis_6_has_no_functions_and_publishes_by_evalsha() -> None:
    with RedisServer(binary=binary_before(7)) as server:
        r6 = server.client()
        store = Store(r6, "")
        for task_id in ("a", "b"):
            store.schedule(
                Due(NOW + 60_000, task_id=task_id), DEST, kombu_payload(task_id), Settings(), now_ms=NOW
            )
        assert store.find("a") and store.find("b")
        assert calls(r6, "evalsha") >= 2
        assert calls(r6, "function") <= 1  # asked once, as an unknown command


def test_a_helper_that_reads_its_arguments_cannot_run_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A function's helpers are made when the library loads, before any call has KEYS or ARGV."""
    real = scripts._read
    fake = {"x": "--- @include y\nreturn 1\n", "_y": "local function y() return ARGV[1] end\n"}
    monkeypatch.setattr(scripts, "_read", lambda name: fake.get(name) or real(name))
    with pytest.raises(ValueError, match="KEYS or ARGV"):
        scripts._split("x")


def loads(r: redis.Redis) -> int:
    """FUNCTION LOAD calls the server took or refused (Redis 7 counts a refusal apart)."""
    stats = r.info("commandstats").get("cmdstat_function|load", {})
    return int(stats.get("calls", 0)) + int(stats.get("rejected_calls", 0))


class Clock:
    def __init__(self) -> None:
        self.s = 0.0

    def __call__(self) -> float:
        return self.s


def test_a_load_refused_for_a_while_is_tried_again_later_not_never(r7: redis.Redis) -> None:
    # One refused load (too few replicas, a failed save) gave up the library for the client's
    # life: every publish ran by EVALSHA, at about a third more of Redis's time.
    clock = Clock()
    library = scripts.Library(r7, monotonic=clock)
    r7.config_set("min-replicas-to-write", 1)
    try:
        assert library.ready() is False
    finally:
        r7.config_set("min-replicas-to-write", 0)
    assert library.ready() is False  # not tried at every publish: each try sends the library
    assert loads(r7) == 1
    clock.s += scripts.LOAD_RETRY_S
    assert library.ready() is True
    assert r7.function_list()


def test_a_library_of_its_name_that_lacks_its_function_is_not_loaded_at_every_publish(
    r7: redis.Redis, caplog
) -> None:
    # Each publish sent the whole library (FUNCTION LOAD: "already exists"), then an FCALL
    # ("Function not found"), then its script: some 80 times the bytes of a publish.
    name = scripts.library()[0]
    r7.function_load(f"#!lua name={name}\nredis.register_function('other', function() return 1 end)")
    clock = Clock()
    store = Store(r7, "")
    store._scripts._library = scripts.Library(r7, monotonic=clock)
    for task_id in "abcde":
        store.schedule(
            Due(NOW + 60_000, task_id=task_id), DEST, kombu_payload(task_id), Settings(), now_ms=NOW
        )
    assert all(store.find(task_id) for task_id in "abcde")
    # The foreign library's load, then two loads and two FCALLs: a library of its name found
    # there again after its function was not found is given up for a while only once its next
    # call finds none either (another publisher may have loaded this one again meanwhile).
    assert loads(r7) == 3 and calls(r7, "fcall") == 2
    told = f"the function library {name} was found twice, 60 s apart, without its function"
    assert told not in caplog.text  # once may be a flush loop's doing
    clock.s += scripts.LOAD_RETRY_S  # tried again later: still not its library, and told
    for task_id in "fg":
        store.schedule(
            Due(NOW + 60_000, task_id=task_id), DEST, kombu_payload(task_id), Settings(), now_ms=NOW
        )
    assert loads(r7) == 5 and calls(r7, "fcall") == 4
    assert told in caplog.text


def test_a_library_deleted_after_another_publisher_loaded_it_is_loaded_again_at_once(
    r7: redis.Redis, caplog
) -> None:
    # A publisher that found the library loaded ("already exists") took its deletion for a
    # foreign library: a false WARNING, and 60 s of EVALSHA with no one loading it again.
    Store(r7, "").schedule(Due(NOW + 60_000, task_id="a"), DEST, kombu_payload("a"), Settings(), now_ms=NOW)
    second = Store(r7, "")
    second.schedule(Due(NOW + 60_000, task_id="b"), DEST, kombu_payload("b"), Settings(), now_ms=NOW)
    r7.function_flush()
    for task_id in "cd":
        second.schedule(
            Due(NOW + 60_000, task_id=task_id), DEST, kombu_payload(task_id), Settings(), now_ms=NOW
        )
    assert all(second.find(task_id) for task_id in "abcd")
    assert r7.function_list()  # loaded again by c's publish
    assert calls(r7, "fcall") == 4  # b, c's (not found), d
    assert "without its function" not in caplog.text


def test_a_script_lost_at_each_try_is_a_refusal_not_a_bug() -> None:
    # A SCRIPT FLUSH in a loop: the mover told the NOSCRIPT that came through its tries as an
    # "unexpected error", with a traceback, about 70 times.
    with pytest.raises(RedisRefused, match="lost kombu-delay's script as it was called"), translated_errors():
        raise redis.exceptions.NoScriptError("No matching script. Please use EVAL.")


def put(store: Store, task_id: str) -> None:
    store.schedule(Due(NOW + 60_000, task_id=task_id), DEST, kombu_payload(task_id), Settings(), now_ms=NOW)


@pytest.mark.parametrize("lister", [True, False], ids=["any-user", "no-function-list"])
def test_a_library_another_publisher_loaded_again_first_is_not_taken_for_a_foreign_one(
    r7: redis.Redis, caplog, lister: bool
) -> None:
    # B found the library loaded; after a flush, A loaded it again before B's next load, whose
    # "already exists" B took for a foreign library: a false WARNING, and 60 s of EVALSHA. (Then
    # asking FUNCTION LIST, which an ACL may refuse, told the library lacking its function.)
    clients = [r7, r7]
    if not lister:
        r7.execute_command("ACL", "SETUSER", "lister", "on", ">pw", "~*", "&*", "+@all", "-function|list")
        port = r7.connection_pool.connection_kwargs["port"]
        clients = [redis.Redis(port=port, username="lister", password="pw") for _ in range(2)]
    first, second = (Store(client, "") for client in clients)
    for task_id, store in (("a", first), ("b", second)):
        put(store, task_id)
    r7.function_flush()
    for task_id, store in (("c", second), ("d", first), ("e", first), ("f", second)):
        put(store, task_id)
    assert all(first.find(task_id) for task_id in "abcdef")
    assert "without its function" not in caplog.text
    assert calls(r7, "fcall") == 6 and calls(r7, "fcall", succeeded=True) == 4  # c's and d's not found
    if not lister:
        for client in clients:
            client.close()


def test_a_library_flushed_again_between_a_load_and_its_call_is_not_told_foreign(
    r7: redis.Redis, caplog
) -> None:
    # A FUNCTION FLUSH loop: found there again, then flushed before the call, kombu-delay's own
    # library read as a foreign one in every publishing process (a WARNING to delete it).
    first, second = Store(r7, ""), Store(r7, "")
    for task_id, store in (("a", first), ("b", second)):
        put(store, task_id)
    r7.function_flush()
    put(second, "c")
    for task_id in ("d", "d2"):  # its function not found, then loaded again
        put(first, task_id)
    load = r7.function_load

    def load_then_flush(*args: Any, **kwargs: Any) -> Any:
        try:
            return load(*args, **kwargs)
        finally:
            r7.function_flush()

    second._scripts._library.client = type(
        "Flushing", (), {"function_load": staticmethod(load_then_flush), "fcall": r7.fcall}
    )()
    put(second, "e")
    assert all(first.find(task_id) for task_id in ("a", "b", "c", "d", "d2", "e"))
    assert second._scripts._library.ready() is False  # for a while: found twice without it
    assert "the function library" not in caplog.text  # no WARNING, whatever its words

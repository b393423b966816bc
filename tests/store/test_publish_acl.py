"""A publisher whose ACL refuses a command its publish runs after storing the message: Redis
keeps a script's earlier writes, so the message was left stored but unindexed, without its
expiry or uncounted, while the call raised, and kombu's retry stored it again; with PEXPIREAT
refused, later publishes returned normally and were never delivered. A publisher now asks the
ACL first (Redis 7), and refuses, writing nothing."""

from __future__ import annotations

import pytest
import redis

from kombu_delay.config import Settings
from kombu_delay.errors import RedisPermissionError, WrongTypeKey, translated_errors
from kombu_delay.message import Due
from kombu_delay.store import Store, keys
from kombu_delay.store.replies import Rescheduled, Scheduled
from tests.support.stored import calls, kombu_payload, redis_ms

ORDINARY = Settings(compress_after_ms=0)


@pytest.mark.parametrize("refused", ["pexpireat", "zrange", "hsetnx", "rpush", "hmget", "hgetall"])
def test_a_publish_the_acl_would_refuse_halfway_writes_nothing_and_names_the_command(
    server7, r7, prefix, refused
):
    r7.execute_command("ACL", "SETUSER", "pub", "reset", "on", ">pw", "~*", "&*", "+@all", f"-{refused}")
    store = Store(server7.client(username="pub", password="pw"), prefix)
    due = Due(redis_ms(r7) + 600_000, task_id="a")
    for _ in range(2):  # a retry (kombu's) is refused again, and writes nothing either
        with pytest.raises(RedisPermissionError, match=f"{refused.upper()} on .*nothing was stored"):
            store.schedule(due, f"{prefix}q", kombu_payload("a"), ORDINARY)
    assert r7.keys(keys.ns(prefix) + "*") == []

    r7.execute_command("ACL", "SETUSER", "pub", f"+{refused}")  # fixed: the next publish stores it
    assert store.schedule(due, f"{prefix}q", kombu_payload("a"), ORDINARY).outcome is Scheduled.STORED
    assert Store(r7, prefix).counts() == {f"{prefix}q": 1}


def test_a_publisher_asks_once_per_destination(server7, r7, prefix):
    store = Store(r7, prefix)
    before = calls(r7, "evalsha", succeeded=True)  # the ask's; a publish on Redis 7 is an FCALL
    for dest in ("q", "q", "q", "other", "q"):
        due = Due(redis_ms(r7) + 600_000, task_id=dest)
        store.schedule(due, f"{prefix}{dest}", kombu_payload(dest), ORDINARY)
    assert calls(r7, "evalsha", succeeded=True) - before == 2


def test_an_acl_narrowed_after_the_ask_is_asked_again_once_it_refuses(server7, r7, prefix):
    r7.execute_command("ACL", "SETUSER", "pub", "reset", "on", ">pw", "~*", "&*", "+@all")
    store = Store(server7.client(username="pub", password="pw"), prefix)
    base = redis_ms(r7) + 600_000
    assert (
        store.schedule(Due(base, task_id="a"), f"{prefix}q", kombu_payload("a"), ORDINARY).outcome
        is Scheduled.STORED
    )
    r7.execute_command("ACL", "SETUSER", "pub", "-pexpireat")
    # Asked before: the next publish, into a bucket of its own, is refused halfway, as Redis does.
    with pytest.raises(RedisPermissionError):
        store.schedule(Due(base + 3_600_000, task_id="b"), f"{prefix}q", kombu_payload("b"), ORDINARY)
    counted = Store(r7, prefix).counts()
    # Its retry is asked again, and refused before it writes.
    with pytest.raises(RedisPermissionError, match=r"PEXPIREAT on .*nothing was stored"):
        store.schedule(Due(base + 3_600_000, task_id="b"), f"{prefix}q", kombu_payload("b"), ORDINARY)
    assert Store(r7, prefix).counts() == counted


def test_a_user_kept_from_another_queues_keys_still_publishes_into_their_bucket(server7, r7, prefix):
    # Extending a bucket's expiry touched every queue's set in it: a user whose key patterns
    # name its own queues was refused there, after its message was stored.
    ns = keys.ns(prefix)
    allowed = [f"~{ns}{name}" for name in ("ids", "counts", "totals", "index", "cindex", "movers")]
    allowed += [f"~{ns}{kind}:*" for kind in ("m", "t", "cm")]
    allowed += [f"~{ns}{kind}:*:{prefix}qA" for kind in ("z", "h", "cz", "ch")] + [f"~{prefix}qA"]
    r7.execute_command("ACL", "SETUSER", "pubA", "reset", "on", ">pw", *allowed, "&*", "+@all")
    due = redis_ms(r7) + 600_000
    Store(r7, prefix).schedule(
        Due(due, task_id="b"),
        f"{prefix}qB",
        kombu_payload("b"),
        Settings(compress_after_ms=0, grace_ms=86_400_000),
    )
    store = Store(server7.client(username="pubA", password="pw"), prefix)
    result = store.schedule(Due(due + 1, task_id="a"), f"{prefix}qA", kombu_payload("a"), ORDINARY)
    assert result.outcome is Scheduled.STORED
    assert Store(r7, prefix).counts() == {f"{prefix}qA": 1, f"{prefix}qB": 1}


@pytest.mark.parametrize("refused", ["exists", "hkeys", "del", "hdel", "zadd", "hsetnx", "pexpireat"])
def test_a_reschedule_the_acl_would_refuse_halfway_changes_nothing(server7, r7, prefix, refused):
    # A reschedule takes the old message out, then stores the new one: a user without EXISTS or
    # HKEYS (which the take's clean-up of the old bucket runs) lost the message; one without
    # HSETNX or PEXPIREAT left it stored unindexed. It now asks first, as a publish does.
    now = redis_ms(r7)
    old_due = Due(now + 600_000, task_id="a")
    Store(r7, prefix).schedule(old_due, f"{prefix}q", kombu_payload("a"), ORDINARY)
    r7.execute_command("ACL", "SETUSER", "ops", "reset", "on", ">pw", "~*", "&*", "+@all", f"-{refused}")
    store = Store(server7.client(username="ops", password="pw"), prefix)
    [stored] = store.find("a")
    with pytest.raises(RedisPermissionError, match=f"{refused.upper()} on .*the message stays as it was"):
        store.reschedule(stored, "a", kombu_payload("a"), now + 7_200_000, ORDINARY)
    assert Store(r7, prefix).find("a") == [stored] and Store(r7, prefix).counts() == {f"{prefix}q": 1}


def test_a_count_the_acl_refuses_fails_the_publish_or_reschedule_and_changes_nothing(server7, r7, prefix):
    """Redis 6 cannot be asked beforehand, as Redis 7 cannot where the ACL narrowed after the
    ask: a publish whose HINCRBY the ACL refused returned as stored, its message in its set but
    counted nowhere, where no mover delivered it and neither ls nor find saw it."""
    r7.execute_command("ACL", "SETUSER", "pub", "reset", "on", ">pw", "~*", "&*", "+@all")
    # Two stores: a refusal makes a store ask again, and each must meet the refusal in its script.
    store, editor = (Store(server7.client(username="pub", password="pw"), prefix) for _ in range(2))
    base = redis_ms(r7) + 600_000
    assert store.schedule(Due(base, task_id="a"), f"{prefix}q", kombu_payload("a"), ORDINARY).outcome is (
        Scheduled.STORED
    )
    [stored] = store.find("a")
    assert (
        editor.reschedule(stored, "a", kombu_payload("a"), base + 60_000, ORDINARY) is Rescheduled.RESCHEDULED
    )
    [stored] = store.find("a")
    r7.execute_command("ACL", "SETUSER", "pub", "-hincrby")  # after both asked: as Redis 6
    admin = Store(r7, prefix)
    refused = (
        r"^Redis's ACL refused this user: (NOPERM )?this user has no permissions to run the 'hincrby' "
        r"command on '[^']+', or to access that key$"
    )
    with pytest.raises(RedisPermissionError, match=refused):
        store.schedule(Due(base + 3_600_000, task_id="b"), f"{prefix}q", kombu_payload("b"), ORDINARY)
    assert admin.find("b") == [] and admin.counts() == {f"{prefix}q": 1}
    assert not r7.exists(keys.queue_set(prefix, keys.bucket_start(base + 3_600_000, 60_000), f"{prefix}q"))
    with pytest.raises(RedisPermissionError, match=refused):
        editor.reschedule(stored, "a", kombu_payload("a"), base + 7_200_000, ORDINARY)
    assert admin.find("a") == [stored] and admin.counts() == {f"{prefix}q": 1}


@pytest.mark.parametrize(
    ("told", "shown"),
    [
        (
            "Error running script (call to f_80fa): @user_script:136: user_script:136: NOPERM this user "
            "has no permissions to run the 'hincrby' command on 'kombu_delay:m:1'",
            "NOPERM this user has no permissions to run the 'hincrby' command on 'kombu_delay:m:1'",
        ),
        (
            "Error running script (call to f_3f5f): @user_script:715: user_script:715: @user_script: 419: "
            "The user executing the script can't run this command or subcommand",
            "The user executing the script can't run this command or subcommand",
        ),
        (
            "The user executing the script can't run this command or subcommand script: 42507f0c, on "
            "@user_script:702.",
            "The user executing the script can't run this command or subcommand",
        ),
    ],
)
def test_an_acl_refusal_from_a_script_is_told_without_where_the_script_raised_it(told, shown):
    # Redis 6's prefix and Redis 7's suffix buried the refusal (the only part that names anything).
    with pytest.raises(RedisPermissionError) as raised, translated_errors():
        raise redis.ResponseError(told)
    assert str(raised.value).startswith(f"Redis's ACL refused this user: {shown}")
    # (Redis names neither the command nor the key from inside a script: the text says so.)
    assert ("Security page" in str(raised.value)) == ("script can't" in shown)


@pytest.mark.parametrize("refused", ["hset", "zadd", "rpush", "hset time"])
def test_what_a_refused_publish_leaves_expires_with_its_bucket(server7, r7, prefix, refused):
    """Redis 6 cannot be asked, as Redis 7 cannot where the ACL narrowed after the ask: a publish
    refused HSET or ZADD into a new bucket, before its expiries were set, left the bucket's meta
    hash, task-id list and the id index's ref without an expiry, for ever."""
    r7.execute_command("ACL", "SETUSER", "pub", "reset", "on", ">pw", "~*", "&*", "+@all")
    store = Store(server7.client(username="pub", password="pw"), f"{prefix}fresh:")
    due = redis_ms(r7) + 600_000
    assert (
        store.schedule(Due(due, task_id="a"), "q", kombu_payload("a"), ORDINARY).outcome is Scheduled.STORED
    )
    r7.execute_command("ACL", "SETUSER", "pub", *(f"-{command}" for command in refused.split()))
    with pytest.raises(RedisPermissionError):  # a new bucket: its expiries not set yet
        store.schedule(Due(due + 3_600_000, task_id="b"), "q", kombu_payload("b"), ORDINARY)
    left = {key: r7.pttl(key) for key in r7.keys(keys.ns(f"{prefix}fresh:") + "*")}
    assert left and all(ttl > 0 for ttl in left.values()), left
    assert Store(r7, f"{prefix}fresh:").find("b") == []


def test_a_shared_key_of_another_type_keeps_no_expiry_from_a_refused_publish(r7, prefix):
    # The error tells an operator to set such a key aside (RENAME): an expiry given it here went
    # with it, and the copy set aside was gone a day after the bucket.
    ids = keys.ids(prefix)
    r7.set(ids, "written by hand")
    with pytest.raises(WrongTypeKey):
        Store(r7, prefix).schedule(
            Due(redis_ms(r7) + 600_000, task_id="a"), f"{prefix}q", kombu_payload("a"), ORDINARY
        )
    assert r7.pttl(ids) == -1
    assert r7.pttl(keys.totals(prefix)) > 0  # its own kind: given the bucket's expiry
    r7.delete(ids)

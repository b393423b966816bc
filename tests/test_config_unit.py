"""Settings, table-driven: options in seconds, environment overrides, CLI-style names, errors."""

from __future__ import annotations

from typing import Any

import pytest
from kombu import Connection

from kombu_delay.config import MAX_DURATION_MS, Settings
from kombu_delay.connect import Target, connection
from kombu_delay.control import DelayControl
from kombu_delay.errors import ConfigError
from kombu_delay.store.keys import MAX_DUE_MS

OK_CASES: list[tuple[str, dict[str, Any], dict[str, str], dict[str, Any]]] = [
    ("defaults", {}, {}, {"bucket_width_ms": 60_000, "grace_ms": 7 * 86_400_000, "max_delay_ms": 0}),
    ("seconds-to-ms", {"delay_bucket_width": 1, "delay_max_sleep": 0.25}, {}, {"bucket_width_ms": 1000,
                                                                              "max_sleep_ms": 250}),
    ("strings-accepted", {"delay_max_delay": "3600", "delay_batch_size": "10"}, {},
     {"max_delay_ms": 3_600_000, "batch_size": 10}),
    ("env-beats-options", {"delay_batch_size": 10}, {"KOMBU_DELAY_BATCH_SIZE": "20"}, {"batch_size": 20}),
    ("empty-env-ignored", {"delay_batch_size": 10}, {"KOMBU_DELAY_BATCH_SIZE": ""}, {"batch_size": 10}),
    ("env-seconds", {}, {"KOMBU_DELAY_GRACE": "86400"}, {"grace_ms": 86_400_000}),
    ("shortest-grace", {"delay_grace": 3600}, {}, {"grace_ms": 3_600_000}),
    ("bool-option", {"delay_embedded_mover": "yes"}, {}, {"embedded_mover": True}),
    ("bool-off", {"delay_embedded_mover": "off"}, {}, {"embedded_mover": False}),
    ("bool-true", {"delay_embedded_mover": True}, {}, {"embedded_mover": True}),
    ("bool-zero", {"delay_embedded_mover": 0}, {}, {"embedded_mover": False}),
    ("kombu-options-ignored", {"global_keyprefix": "x:", "visibility_timeout": 10}, {}, {"batch_size": 500}),
    ("batch-at-limit", {"delay_batch_size": 5000}, {}, {"batch_size": 5000}),
    ("whole-counts", {"delay_max_rate": 5.0, "delay_max_queue_length": "100"},
     {"KOMBU_DELAY_BATCH_SIZE": "1e3"}, {"max_rate": 5, "max_queue_length": 100, "batch_size": 1000}),
    ("one-ms", {"delay_max_delay": 0.001, "delay_max_sleep": "0.0015"}, {}, {"max_delay_ms": 1,
                                                                           "max_sleep_ms": 2}),
    ("longest-grace-and-width", {"delay_grace": 4398046511, "delay_bucket_width": "4398046511"}, {},
     {"grace_ms": 4_398_046_511_000, "bucket_width_ms": 4_398_046_511_000}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "options", "env", "expected"), OK_CASES, ids=[c[0] for c in OK_CASES])
def test_from_options(name, options, env, expected):
    settings = Settings.from_options(options, env=env)
    for field, value in expected.items():
        assert getattr(settings, field) == value


BAD_CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "unknown-option",
        {"delay_bucket_wdith": 1},
        "unknown transport option 'delay_bucket_wdith' .delay_bucket_width..",
    ),
    ("unknown-unlike-any", {"delay_colour": 1}, "unknown transport option 'delay_colour'; known: "),
    ("zero-width", {"delay_bucket_width": 0}, "delay_bucket_width must be positive"),
    # A grace shorter than a mover restart deletes what no mover is there to renew.
    ("negative-grace", {"delay_grace": -1}, "delay_grace must be at least 3600 s .1 hour., got -1 s"),
    ("zero-grace", {"delay_grace": 0}, "delay_grace must be at least 3600 s .1 hour., got 0 s"),
    ("tiny-grace", {"delay_grace": "59"}, "delay_grace must be at least 3600 s"),
    ("just-short-grace", {"delay_grace": 3599.999}, "delay_grace must be at least 3600 s"),
    ("not-a-number", {"delay_max_delay": "ten"}, "delay_max_delay must be a number"),
    ("nan", {"delay_max_sleep": "nan"}, "delay_max_sleep must be a number"),
    ("bool-as-number", {"delay_batch_size": True}, "delay_batch_size must be a number"),
    ("bad-bool", {"delay_embedded_mover": "maybe"}, "delay_embedded_mover is on or off"),
    # True by their truth, they turned an embedded mover on.
    *(
        (f"bad-bool-{name}", {"delay_embedded_mover": raw}, "delay_embedded_mover is on or off")
        for name, raw in {
            "bytes": b"false",
            "minus-one": -1,
            "nan": float("nan"),
            "list": [0],
            "fraction": 0.5,
        }.items()
    ),
    ("batch-too-big", {"delay_batch_size": 5001}, "at most 5000"),
    # A fraction of a count used to become 0, which switches the limit off.
    ("fractional-rate", {"delay_max_rate": 0.5}, "delay_max_rate must be a whole number, got 0.5"),
    ("fractional-rate-text", {"delay_max_rate": "2.5"}, "delay_max_rate must be a whole number"),
    ("fractional-length", {"delay_max_queue_length": 0.9}, "delay_max_queue_length must be a whole number"),
    ("fractional-batch", {"delay_batch_size": 10.5}, "delay_batch_size must be a whole number"),
    ("negative-fraction", {"delay_max_rate": -0.5}, "delay_max_rate must be a whole number"),
    ("huge-int", {"delay_max_queue_length": 10**400}, "delay_max_queue_length must be a number"),
    # Likewise a positive duration under 1 ms: 0 is "no limit" for delay_max_delay.
    ("sub-ms-delay", {"delay_max_delay": 0.0004}, "delay_max_delay must be at least 0.001 s"),
    ("sub-ms-sleep", {"delay_max_sleep": "0.0001"}, "delay_max_sleep must be at least 0.001 s"),
    # Seconds * 1000 overflowed a float to infinity: a traceback, not this error.
    ("overflowing-sleep", {"delay_max_sleep": "1e308"}, "^delay_max_sleep must be at most 4398046511 s"),
    ("overflowing-grace", {"delay_grace": 1e306}, "^delay_grace must be at most 4398046511 s"),
    ("overflowing-negative", {"delay_max_delay": -1e308}, "^delay_max_delay must not be negative"),
    # Accepted, the expiry a publish sets was past what Redis takes from a script, which then
    # failed after storing the message: a retry stored it twice.
    ("grace-past-the-span", {"delay_grace": 1e14}, "^delay_grace must be at most 4398046511 s"),
    (
        "width-past-the-span",
        {"delay_bucket_width": 4398046512},
        "^delay_bucket_width must be at most 4398046511 s",
    ),
]


@pytest.mark.parametrize(("name", "options", "message"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_options_name_the_option(name, options, message):
    with pytest.raises(ConfigError, match=message):
        Settings.from_options(options, env={})


@pytest.mark.parametrize(
    ("var", "value"),
    [("KOMBU_DELAY_MAX_RATE", "0.5"), ("KOMBU_DELAY_MAX_QUEUE_LENGTH", "0.5"), ("KOMBU_DELAY_GRACE", "1e-4")],
)
def test_env_never_turns_a_positive_limit_into_zero(var, value):
    option = "delay_" + var[len("KOMBU_DELAY_") :].lower()
    with pytest.raises(ConfigError, match=f"^{option} must be"):
        Settings.from_options({}, env={var: value})


@pytest.mark.parametrize(
    ("var", "value"), [("KOMBU_DELAY_MAX_DELAY", "1e308"), ("KOMBU_DELAY_HEARTBEAT_INTERVAL", "-1e308")]
)
def test_env_durations_out_of_range_are_config_errors(var, value):
    option = "delay_" + var[len("KOMBU_DELAY_") :].lower()
    with pytest.raises(ConfigError, match=f"^{option} must"):
        Settings.from_options({}, env={var: value})


@pytest.mark.parametrize(
    "field",
    ["grace_ms", "bucket_width_ms", "max_delay_ms", "max_sleep_ms", "thaw_ahead_ms"],
)
def test_settings_refuse_a_duration_past_the_span_of_due_times(field):
    assert MAX_DURATION_MS == MAX_DUE_MS  # spelled again in config, which the store imports
    Settings(**{field: MAX_DURATION_MS})
    with pytest.raises(ConfigError, match=f"^delay_{field[:-3]} must be at most 4398046511 s"):
        Settings(**{field: MAX_DURATION_MS + 1})


def test_a_heartbeat_interval_is_refused_where_readers_would_take_the_mover_for_stopped():
    # 60 s: a healthy mover was "silent for over 30 s" to health (which failed its liveness
    # probe, restarting it), stats and publishers.
    assert Settings().with_values(heartbeat_interval=10).heartbeat_interval_ms == 10_000
    with pytest.raises(ConfigError, match=r"^delay_heartbeat_interval must be at most 10 s, got 10\.001 s"):
        Settings().with_values(heartbeat_interval=10.001)
    with pytest.raises(ConfigError, match=r"^delay_heartbeat_interval must be at most 10 s"):
        Settings.from_options({}, env={"KOMBU_DELAY_HEARTBEAT_INTERVAL": "60"})


@pytest.mark.parametrize("values", [{"max_rate": 0.5}, {"max_queue_length": "0.5"}, {"max_delay": 0.0001}])
def test_with_values_never_turns_a_positive_limit_into_zero(values):
    with pytest.raises(ConfigError):
        Settings().with_values(**values)


@pytest.mark.parametrize(
    ("values", "field", "expected"),
    [
        ({"max_sleep": 60}, "max_sleep_ms", 60_000),  # the CLI's --max-sleep
        ({"max_sleep_ms": 2}, "max_sleep_ms", 2000),
        ({"max_rate": "5"}, "max_rate", 5),
        ({"batch_size": None}, "batch_size", 500),  # flag not given
        ({"bucket_width": 0.5}, "bucket_width_ms", 500),
    ],
)
def test_with_values_takes_cli_names_in_user_units(values, field, expected):
    assert getattr(Settings().with_values(**values), field) == expected


@pytest.mark.parametrize(
    ("options", "env", "message"),
    [
        ({"delay_batch_size": 0}, {"KOMBU_DELAY_BATCH_SIZE": "10"}, "^delay_batch_size must be positive"),
        ({"delay_grace": "abc"}, {"KOMBU_DELAY_GRACE": "7200"}, "^delay_grace must be a number"),
    ],
)
def test_a_bad_option_is_refused_even_where_a_variable_overrides_it(options, env, message):
    """As the docs say of every source: a variable had replaced the option before any check."""
    with pytest.raises(ConfigError, match=message):
        Settings.from_options(options, env=env)
    assert Settings.from_options({}, env=env)  # the variable alone is good


@pytest.mark.parametrize(
    ("options", "overrides", "refused"),
    [
        ({"visibility_timeout": 20}, {"look_ahead": 60}, True),  # it ran three times
        ({"visibility_timeout": 20, "delay_look_ahead": 20}, {}, True),
        ({"visibility_timeout": 20}, {"look_ahead": 19}, False),
        ({}, {"look_ahead": 60}, False),  # kombu's default: an hour
        ({"visibility_timeout": 5}, {}, False),  # no look-ahead
    ],
)
def test_a_look_ahead_not_shorter_than_the_visibility_timeout_is_refused(options, overrides, refused):
    target = Target("delayredis://127.0.0.1:1/0", options, overrides)
    if refused:
        with pytest.raises(
            ConfigError, match=r"delay_look_ahead \(\d+ s\) must be shorter than visibility_timeout"
        ):
            target.settings()
    else:
        assert target.settings().look_ahead_ms == 1000 * overrides.get("look_ahead", 0)


@pytest.mark.parametrize(
    ("options", "source", "told"),
    [
        ({}, "--broker", True),  # it ran every task moved ahead three times, unsaid
        ({"visibility_timeout": 20}, "--broker", False),
        ({}, "the Celery app's broker_url", False),  # the workers' own settings
    ],
)
def test_a_look_ahead_checked_against_kombus_default_timeout_is_told(options, source, told):
    from kombu_delay.cli.mover import look_ahead_unchecked

    target = Target("delayredis://127.0.0.1:1/0", options, source=source)
    said = look_ahead_unchecked(target, 30_000)
    assert (said is not None) is told
    assert said is None or "checked against kombu's default visibility_timeout (3600 s)" in said
    assert look_ahead_unchecked(target, 0) is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"global_keyprefix": 5}, "global_keyprefix must be text, got 5"),  # a traceback at its first key
        (
            {"socket_timeout": 0},
            "socket_timeout must be a number of seconds above 0",
        ),  # "unavailable" for ever
        ({"socket_connect_timeout": -1.5}, "socket_connect_timeout must be a number of seconds above 0"),
        (
            {"socket_timeout": float("inf")},
            "socket_timeout must be a number of seconds above 0",
        ),  # OverflowError
        (
            {"socket_connect_timeout": 1e10},
            "socket_connect_timeout must be a number of seconds above 0",
        ),  # too
        (
            {"max_connections": 3.0},
            "max_connections must be a whole number",
        ),  # slipped past the mover's check
    ],
)
def test_a_connection_option_that_would_fail_later_is_refused_when_given(options, message):
    with pytest.raises(ConfigError, match=message):
        connection("delayredis://127.0.0.1:1/0", options)
    connection(
        "delayredis://127.0.0.1:1/0", {"socket_timeout": 2.5, "max_connections": 4, "global_keyprefix": "a:"}
    )


@pytest.mark.parametrize(
    "values",
    [
        {"batch_size": 1.5},
        {"max_rate": 0.5},
        {"batch_size": True},
        {"max_sleep_ms": float("nan")},
        {"embedded_mover": "false"},
    ],
)
def test_settings_built_by_hand_take_only_what_the_options_would_give(values):
    # Settings is public, and its constructor skipped the options' conversions.
    with pytest.raises(ConfigError, match=r"must be a whole number|is True or False"):
        Settings(**values)


@pytest.mark.parametrize(
    "options", [{"socket_timeout": False}, {"socket_connect_timeout": False}, {"global_keyprefix": b"app:"}]
)
def test_delay_control_checks_the_options_of_a_connection_it_is_given(options):
    # socket_timeout=false is a timeout of 0 (a non-blocking socket); a Connection handed to
    # DelayControl skipped the checks its URL form makes.
    with pytest.raises(ConfigError, match=r"socket_timeout|socket_connect_timeout|global_keyprefix"):
        connection("delayredis://127.0.0.1:1/0", options)
    with pytest.raises(ConfigError, match=r"socket_timeout|socket_connect_timeout|global_keyprefix"):
        DelayControl(Connection("delayredis://127.0.0.1:1/0", transport_options=options))


def test_a_variable_spelled_nearly_as_a_setting_s_is_told_once_and_others_are_left_alone(monkeypatch, caplog):
    # KOMBU_DELAY_MAXRATE=5 left the mover at full speed, unsaid (the same typo as an option is refused).
    from kombu_delay import config

    monkeypatch.setattr(config, "_misspelt_told", set())
    env = {"KOMBU_DELAY_MAXRATE": "5", "KOMBU_DELAY_BROKER": "redis://h", "KOMBU_DELAY_WEB_AUTH": "a:b"}
    with caplog.at_level("WARNING", logger="kombu_delay.config"):
        assert Settings.from_options({}, env).max_rate == 0
        Settings.from_options({}, env)
    assert [r.getMessage() for r in caplog.records] == [
        "kombu-delay: KOMBU_DELAY_MAXRATE is no setting's variable, and is ignored: KOMBU_DELAY_MAX_RATE?"
    ]


@pytest.mark.parametrize(
    ("var", "meant"),
    [
        ("KOMBU_DELAY_EMBEDDED", "KOMBU_DELAY_EMBEDDED_MOVER"),  # a worker ran with no mover, unsaid
        ("KOMBU_DELAY_RATE", "KOMBU_DELAY_MAX_RATE"),  # was "KOMBU_DELAY_GRACE?"
        ("KOMBU_DELAY_MAX_RATE_LIMIT", "KOMBU_DELAY_MAX_RATE"),
        ("kombu_delay_max_rate", "KOMBU_DELAY_MAX_RATE"),
        # was "KOMBU_DELAY_MAX_RATE?" alone
        (
            "KOMBU_DELAY_MAX",
            "one of KOMBU_DELAY_MAX_DELAY, KOMBU_DELAY_MAX_QUEUE_LENGTH, KOMBU_DELAY_MAX_RATE "
            "or KOMBU_DELAY_MAX_SLEEP",
        ),
    ],
)
def test_a_variable_meant_for_a_setting_is_told_with_the_one_meant(monkeypatch, caplog, var, meant):
    from kombu_delay import config

    monkeypatch.setattr(config, "_misspelt_told", set())
    others = ("BROKER", "WEB_AUTH", "DEMO_BROKER", "CHAOS", "BENCH_BROKER", "REQUIRE_BROWSER", "X")
    env = {var: "5", **{f"KOMBU_DELAY_{other}": "1" for other in others}}
    with caplog.at_level("WARNING", logger="kombu_delay.config"):
        Settings.from_options({}, env)
    assert [r.getMessage() for r in caplog.records] == [
        f"kombu-delay: {var} is no setting's variable, and is ignored: {meant}?"
    ]


def test_a_delay_option_given_without_its_prefix_is_told_once(monkeypatch, caplog):
    # -o max_rate=5 ran the mover with no cap, unsaid: kombu takes any transport option.
    from kombu_delay import config

    monkeypatch.setattr(config, "_misspelt_told", set())
    with caplog.at_level("WARNING", logger="kombu_delay.config"):
        assert Settings.from_options({"max_rate": 5, "visibility_timeout": 60}, {}).max_rate == 0
        Settings.from_options({"max_rate": 5}, {})
    assert [r.getMessage() for r in caplog.records] == [
        "kombu-delay: transport option 'max_rate' is not read: delay_max_rate?"
    ]


def test_an_option_no_one_reads_is_told_with_what_was_meant(monkeypatch, caplog):
    # -o socket_timout=5 and -o ssl_ca_certs=... were taken without a word, and read by no one.
    from kombu_delay import config

    monkeypatch.setattr(config, "_misspelt_told", set())
    real = {
        "socket_timeout": 5,
        "visibility_timeout": 60,
        "global_keyprefix": "a:",
        "master_name": "m",
        "max_retries": 3,
        "polling_interval": 1,
        "unacked_restore_limit": 10,
        "my_own_option": 1,
    }
    with caplog.at_level("WARNING", logger="kombu_delay.config"):
        Settings.from_options(real, {})
        assert caplog.records == []  # kombu's own, and a name nothing resembles: kombu takes any
        Settings.from_options({"socket_timout": 5, "ssl_ca_certs": "/ca.pem"}, {})
    assert [r.getMessage() for r in caplog.records] == [
        "kombu-delay: transport option 'socket_timout' is not read: socket_timeout?",
        "kombu-delay: transport option 'ssl_ca_certs' is not read: TLS options go in Celery's "
        "broker_use_ssl, or the broker URL's query (?ssl_ca_certs=...)",
    ]


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("DELAY_MAX_RATE", "delay_max_rate"),
        ("Delay_max_rat", "delay_max_rate"),
        ("max_rat", "delay_max_rate"),
        ("VISIBILITY_TIMEOUT", "visibility_timeout"),  # kombu's own, in another case
    ],
)
def test_a_delay_option_in_another_case_or_misspelt_without_its_prefix_is_told(
    given, meant, monkeypatch, caplog
):
    # -o DELAY_MAX_RATE=5, -o Delay_max_rate=5 and -o max_rat=3 were ignored without a word.
    from kombu_delay import config

    monkeypatch.setattr(config, "_misspelt_told", set())
    with caplog.at_level("WARNING", logger="kombu_delay.config"):
        assert Settings.from_options({given: 5}, {}).max_rate == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"kombu-delay: transport option {given!r} is not read: {meant}?"
    ]


@pytest.mark.parametrize("raw", ["99999999999999999999999", 99999999999999999999999])
def test_a_whole_count_is_read_as_given_not_through_a_float(raw):
    # "got 99999999999999991611392": a number no one gave, as a float rounds it past 2**53.
    with pytest.raises(ConfigError, match=r"at most 5000, got 99999999999999999999999$"):
        Settings.from_options({"delay_batch_size": raw}, {})
    assert Settings.from_options({"delay_max_rate": raw}, {}).max_rate == 99999999999999999999999
    assert Settings.from_options({}, {"KOMBU_DELAY_MAX_RATE": " +9007199254740993 "}).max_rate == 2**53 + 1

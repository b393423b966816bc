"""The overview is built once per moment and shared by every request waiting for it, a
failure included."""

from __future__ import annotations

from typing import Any

import pytest

from kombu_delay.errors import RedisUnavailable
from kombu_delay.web import overview


def test_a_failed_overview_is_shared_with_the_requests_that_waited_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Behind a Redis that stalled, each waiting request built the overview again in turn, and
    # each waited out its own socket timeout: four open tabs answered after 10, 20, 30, 40 s.
    built: list[str] = []

    def stalled(control: Any, range_name: str, max_buckets: int) -> overview.Overview:
        built.append(range_name)
        raise RedisUnavailable("Redis did not answer within socket_timeout")

    monkeypatch.setattr(overview, "build", stalled)
    shared = overview.Shared(control=None, max_buckets=10, share_s=3600)  # type: ignore[arg-type]
    for _ in range(3):
        with pytest.raises(RedisUnavailable):
            shared.get("hours")
    assert built == ["hours"]
    shared.share_s = 0  # the moment has passed: the next request tries again
    with pytest.raises(RedisUnavailable):
        shared.get("hours")
    assert built == ["hours", "hours"]

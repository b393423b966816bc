"""The mover: moves due messages onto their lists, thaws compressed ones, sweeps (:mod:`.loop`)."""

from __future__ import annotations

import os
import socket
import uuid
from contextlib import suppress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kombu_delay.store import Store


def mover_id() -> str:
    """A fresh name for a mover: its host, its process and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def misshapen_told(store: Store) -> str:
    """``; <sentence>`` for each key the namespace shares that is of another type (Redis's
    error, from a script, names none), for a line that tells an error; ``""`` where there is
    none or they cannot be read (the error at hand is the one to tell)."""
    with suppress(Exception):
        return "".join(f"; {text}" for text in store.misshapen().values())
    return ""

"""The mover: moves due messages onto their lists, thaws compressed ones, sweeps (:mod:`.loop`)."""

from __future__ import annotations

import os
import socket
import uuid


def mover_id() -> str:
    """A fresh name for a mover: its host, its process and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

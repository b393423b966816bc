"""The benchmark's scenarios, in run order: one module per family, one line each here.

Each scenario takes a :class:`Ctx` (see :mod:`kombu_delay.tooling.bench.ctx`), starts from an
empty database, and returns a JSON-ready dict.
"""

from __future__ import annotations

from kombu_delay.tooling.bench.backpressure import backpressure
from kombu_delay.tooling.bench.basics import burst, precision, publish
from kombu_delay.tooling.bench.cpu import cpu
from kombu_delay.tooling.bench.ctx import Ctx, Sizes
from kombu_delay.tooling.bench.herd import herd, thaw
from kombu_delay.tooling.bench.memory import memory
from kombu_delay.tooling.bench.scale import scale

__all__ = ["SCENARIOS", "Ctx", "Sizes"]

SCENARIOS = {
    "publish": publish,
    "precision": precision,
    "burst": burst,
    "memory": memory,
    "thaw": thaw,
    "cpu": cpu,
    "backpressure": backpressure,
    "scale": scale,
    "herd": herd,
}

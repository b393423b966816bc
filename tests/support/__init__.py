"""What the tests share, one concern a module: ``procs`` (child processes, waiting), ``stored``
(reading what Redis holds, test payloads, driven clocks), ``workers`` (real Celery workers and
their ledgers), ``cli`` (the commands, as a user runs them), ``metrics``, ``servers`` (password
and TLS-only redis-servers), ``sentinel`` and ``faults`` (ledgers and invariants of the fault
suite); and the small Celery apps real workers load (``*_app``). Fixtures live in
``tests/conftest.py``."""

"""What the tests share: helpers (procs, stored, clock, workers, cli, metrics, faults, sentinel)
and the small Celery apps that real worker processes load (``*_app``). Fixtures live in
``tests/conftest.py``."""

"""Celery settings. Moving delayed tasks into Redis is the one-line broker change below.

``CELERY_BROKER_URL`` in the environment overrides ``broker_url``, as always in Celery: give it
the ``delayredis://`` scheme too (a ``redis://`` one publishes countdowns straight to the workers).
"""

# was: broker_url = "redis://localhost:6379/0"
broker_url = "delayredis://localhost:6379/0"

# Optional: kombu-delay reads its options from the transport options (or KOMBU_DELAY_*
# variables). Workers consume exactly as before; only publishers and movers read these.
broker_transport_options = {
    "visibility_timeout": 3600,  # kombu's own option: unchanged meaning
    "delay_max_delay": 30 * 86400,  # refuse ETAs more than 30 days out
}

task_serializer = "json"
accept_content = ["json"]
imports = ["proj.tasks"]

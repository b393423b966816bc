"""Tasks. Nothing here changes: countdown= and eta= work as in any Celery project."""

import time

from .celery import app


@app.task
def send_reminder(user_id: int, due_ms: int) -> str:
    """Pretend to remind a user; report how late (ms) past the requested time it ran."""
    late_ms = int(time.time() * 1000) - due_ms
    print(f"reminder for user {user_id}: {late_ms} ms after its ETA")
    return f"user {user_id} reminded {late_ms} ms after its ETA"

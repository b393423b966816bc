"""Schedule a few reminders: ``python -m proj.schedule [COUNT]`` from this directory."""

import sys
import time

from .tasks import send_reminder


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for user_id in range(1, count + 1):
        countdown = 2 * user_id  # seconds; days or weeks work the same way
        due_ms = int(time.time() * 1000) + countdown * 1000
        result = send_reminder.apply_async((user_id, due_ms), countdown=countdown)
        print(f"scheduled reminder {result.id} for user {user_id} in {countdown} s")


if __name__ == "__main__":
    main()

"""What a key of another type (written by hand) means, where kombu-delay expects one of its own:
the texts :meth:`~kombu_delay.store.base.StoreBase.misshapen` tells."""

from __future__ import annotations

from collections.abc import Callable

from kombu_delay.store import keys, spaces

#: The namespace's hints, each by the function that names it from the key prefix, with its
#: type and what is lost while it holds another: the scripts pass over a hint they cannot
#: write (as they do the wake mark), so only :meth:`Store.misshapen` tells.
HINTS: dict[Callable[[str], str], tuple[str, str]] = {
    spaces.ORDINARY.large: ("zset", "the movers' plans miss its large buckets, which may then be late"),
    spaces.COLD.large: ("zset", "the movers' plans miss its large cold buckets, which may then be late"),
    keys.lists: ("hash", "a delayed message's push renews the expiry of its own priority list only"),
    keys.taken: (
        "zset",
        "edits note nothing of what they take, so kombu's retry of a publish whose reply was lost "
        "can store a message cancelled meanwhile again",
    ),
    keys.walk: ("hash", "every mover walks the id index, not one at a time"),
}


#: What a bucket's key of another type means: by the type it should be (a meta hash, a queue's
#: set, a task-id list), or ``cold`` for a compressed bucket's meta hash.
BUCKET_KEY_TOLD = {
    "hash": "a bucket's meta hash, which listing and publishing read: until the bucket's first move "
    "each publish due in it fails, storing nothing; then a mover renames the key out of the way and "
    "counts the bucket again from its sorted sets, and its messages move on time (where the mover "
    "may not RENAME, they are lost then: rename it yourself first)",
    "zset": "a bucket's sorted set, which held its messages for one queue: they are gone with it "
    "(a mover counts them as lost at their due time); rename it out of the way (RENAME) or delete it",
    "list": "a bucket's task-id list, which the clean-up of the id index reads: rename it out of the "
    "way (RENAME) and kombu-delay makes it anew",
    "cold": "a compressed bucket's meta hash, which listing and thawing read: rename it out of the "
    "way (RENAME) before its thaw and a mover counts the bucket again from its sorted sets (until "
    "then find and cancel may miss its messages); at its thaw, what it holds is lost",
}

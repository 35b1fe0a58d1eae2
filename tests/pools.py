"""A user's connection pool spec, the way the checks' tests write it with one step varied.

``check``'s holders (tests/test_check_holders.py) and ``verify``'s exact-change
contracts (tests/test_verify.py) read the same spec: written once here.
"""

from __future__ import annotations


POOL = """
[machine]
name = "conn_pool"
initial = "idle"

[counters]
holders = 0

[states]
idle = { invariant = "holders == 0" }
leased = { invariant = "holders >= 1", counter = "holders" }

[[transition]]
event = "acquire"
source = "idle"
dest = "leased"
update = "ACQUIRE"

[[transition]]
event = "acquire"
source = "leased"
dest = "leased"
update = "holders += 1"

[[transition]]
event = "release"
source = "leased"
dest = "leased"
guard = "holders >= 2"
update = "holders -= 1"

[[transition]]
event = "release"
source = "leased"
dest = "idle"
guard = "holders == 1"
update = "LAST"
AT_ZERO
"""

REFUSED = """
[[forbid]]
event = "release"
source = "idle"
error = "ReleaseAtZero"
reason = "release without a matching acquire"
"""

ACCEPTED = """
[[transition]]
event = "release"
source = "idle"
dest = "idle"
"""


def pool(acquire: str = "holders += 1", last: str = "holders -= 1", at_zero: str = REFUSED) -> str:
    """The pool's text: the first acquire's update, the last release's, and what a release at zero does."""
    return POOL.replace("ACQUIRE", acquire).replace("LAST", last).replace("AT_ZERO", at_zero)

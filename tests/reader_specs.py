"""A block its readers hold, in two forms whose holds cannot all be given back.

``FINAL_HOLD``: reading is final and no event gives a reader back.
``STUCK_AT_THREE``: three readers can never finish, a livelock above the model
checker's default ceiling of 2 (a ``touch`` keeps it from being a deadlock,
which the loader refuses).
``ALL_AT_ONCE``: ``done`` lets every reader go at once (``readers = 0``), a step
the holders' account takes as neither a hold nor a give-back.
"""

_READERS = """
[machine]
name = "block"
initial = "free"

[counters]
readers = 0

[states]
free = {{ invariant = "readers == 0" }}
reading = {{ {final}invariant = "readers >= 1 and readers <= {most}", counter = "readers" }}

[events]
load = {{ doc = "a reader starts" }}
done = {{ doc = "a reader finished" }}
{events}
[[transition]]
event = "load"
source = "free"
dest = "reading"
update = "readers = 1"

[[transition]]
event = "load"
source = "reading"
dest = "reading"
guard = "readers <= {below}"
update = "readers += 1"

[[forbid]]
event = "load"
source = "reading"
guard = "readers >= {most}"
error = "TooMany"
reason = "{most} readers at most"

[[forbid]]
event = "done"
source = {done_refused}
error = "NotNow"
reason = "no reader to finish"
{rules}"""

FINAL_HOLD = _READERS.format(
    final="final = true, ", most=2, below=1, events="", done_refused='["free", "reading"]', rules=""
)

STUCK_AT_THREE = _READERS.format(
    final="",
    most=3,
    below=2,
    events='touch = { doc = "a reader reads" }\n',
    done_refused='"free"',
    rules="""
[[transition]]
event = "done"
source = "reading"
dest = "free"
guard = "readers == 1"
update = "readers = 0"

[[transition]]
event = "done"
source = "reading"
dest = "reading"
guard = "readers == 2"
update = "readers -= 1"

[[forbid]]
event = "done"
source = "reading"
guard = "readers >= 3"
error = "WaitForOthers"
reason = "the others finish first"

[[transition]]
event = "touch"
source = "reading"
dest = "reading"

[[forbid]]
event = "touch"
source = "free"
error = "NotNow"
reason = "no reader"
""",
)

ALL_AT_ONCE = _READERS.format(
    final="",
    most=2,
    below=1,
    events="",
    done_refused='"free"',
    rules="""
[[transition]]
event = "done"
source = "reading"
dest = "free"
update = "readers = 0"
""",
)

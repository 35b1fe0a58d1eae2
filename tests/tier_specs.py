"""A one-region machine of a tier's copy, for tests that compose several (``.format(name=...)``)."""

TIER = """
[machine]
name = "{name}"
initial = "empty"
label = "node"
doc = "Whether a node has a copy in a tier."

[states]
empty = {{ doc = "No copy." }}
filling = {{ doc = "A copy is being made." }}
full = {{ doc = "The copy is there." }}

[events]
fill = {{ doc = "Start a copy, or finish it.", past = "filled" }}
drop = {{ doc = "Free the copy.", past = "dropped" }}

[[transition]]
event = "fill"
source = "empty"
dest = "filling"

[[transition]]
event = "fill"
source = "filling"
dest = "full"

[[transition]]
event = "drop"
source = ["filling", "full"]
dest = "empty"

[[forbid]]
event = "drop"
source = "empty"
error = "IllegalTransition"
reason = "there is no copy to free"

[[forbid]]
event = "fill"
source = "full"
error = "IllegalTransition"
reason = "the copy is there already"
"""

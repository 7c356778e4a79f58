"""The sharing model: every allocatable unit of both front ends, its size, and what its container gets.

``replicas`` turns GPUs into the device plugin's time-sliced units, ``pool`` into the DRA driver's devices (whole,
partitions, consumable), ``shares`` into what one claim was given, ``policy`` chooses units for a request, and
``edits`` builds every container edit from them. Front ends only speak their protocol.
"""

"""Distribution wraps the components, it does not fork them.

`turnrl.dist.ray` runs engine replicas and rollout workers as Ray actors around the same engine, Router,
RolloutManager and turn loop a single process uses (install the `ray` extra). Nothing here is imported by
the single-process path.
"""

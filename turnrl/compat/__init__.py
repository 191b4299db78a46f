"""Code written for the reference frameworks, run on turnrl with only its import lines changed.

    turnrl.compat.slime   slime's `Sample`, its graders and `args`: interaction envs (`build_env(sample, args)`)
    turnrl.compat.verl    verl's `BaseTool`, tool schemas, `ToolResponse`, `rollout_trace_op`, reward scores
    turnrl.compat.swift   ms-swift's `MultiTurnScheduler`, gym `Env` and the `envs` / `multi_turns` registries

Each is a thin adapter onto turnrl's own contracts (turnrl.envs.base, turnrl.tools, turnrl.agents.scheduler);
the core knows none of these shapes. The migration guides are docs/from-slime.md, docs/from-verl.md and
docs/from-ms-swift.md.
"""

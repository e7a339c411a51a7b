"""Pipeline parallelism: schedules as data, a simulator, and the runtime that executes them (lecture 03)."""

"""Pipeline parallelism (lecture 03): schedules as data, a simulator, and the executor that runs them."""

"""One grader per lab: ``ROLES``, ``adapter(lab_dir)``, the checks and ``TASKS``."""

"""One module per lab: ``TASKS``, a list of :class:`course_lib.grade.Task`."""

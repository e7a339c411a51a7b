"""course_lib: the library the lectures of the course build, chapter by chapter."""

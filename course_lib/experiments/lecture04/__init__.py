"""Lecture 4's runs: see the index in :mod:`course_lib.experiments`."""

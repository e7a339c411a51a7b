"""Lecture 08's runs (both parts, 08a and 08b): see the index in :mod:`course_lib.experiments`."""

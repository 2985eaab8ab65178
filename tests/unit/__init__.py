"""Unit tests: one module or part of the library each, named after it."""

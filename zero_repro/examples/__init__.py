"""Runnable examples of the runtime used directly (no CLI, no harness)."""

"""Peer frameworks side by side with this project's ZeRO stages (equivalence and speed)."""

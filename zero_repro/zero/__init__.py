"""ZeRO-DP (paper §5): one Strategy per stage behind one interface (see strategy.py)."""
from zero_repro.zero.strategy import StepInfo, Strategy, build_strategy  # noqa: F401

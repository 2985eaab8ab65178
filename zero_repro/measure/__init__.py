"""Measurement: memory ledger, records."""
from zero_repro.measure.ledger import MemoryLedger  # noqa: F401

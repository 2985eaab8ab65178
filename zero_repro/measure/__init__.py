"""Measurement: memory ledger, records."""
from zero_repro.measure.ledger import MemoryLedger, table1_bytes  # noqa: F401

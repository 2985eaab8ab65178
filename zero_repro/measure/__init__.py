"""Measurement at paper scale and on this machine: the closed-form memory model (analytic).
(The memory ledger type the runtime fills lives in ``zero_repro.zero.ledger``; run records in
``zero_repro.harness.records``.)"""

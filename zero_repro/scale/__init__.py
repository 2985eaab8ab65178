"""The paper at scale without the hardware: the paper's facts (``paper``), the closed-form memory
model (``analytic``, Tables 1-2), the closed-form throughput model and its calibration
(``perf_model``, ``calibrate``), device specs (``hardware``), and the executed dry run
(``dryrun``). Imports the runtime and config, never the lab."""

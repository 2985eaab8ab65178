"""Planning, simulating and running the points of the throughput figures (paper §10.2-10.5:
Figure 2 model size, Figure 3 super-linear scaling, Figure 4 ZeRO-DP only, Figure 8 C1-C5):
``setups`` (their names, parameters and paper setups), ``batch`` (the batch per GPU: the
max-fit search), ``plan`` (the points), ``simulate`` (the calibrated model), ``run`` (a point
run). Their tables and figures are ``lab.figures``'s; this package imports nothing of it.

Three kinds of points, always labelled (``kind`` column):

* ``simulated`` at paper scale: the paper's setups (Tables 5, 6, 9, 10 via
  ``zero_repro.scale.paper.setups``) through the calibrated performance model
  (``zero_repro.scale.calibrate``: 2 parameters fitted ONLY on Figure 2's ZeRO series, on the
  paper's DGX-2 V100 cluster). Throughput per GPU = F/tp / T with F the Megatron FLOPs of one
  iteration (96·B·s·l·h²·(1 + s/6h + V/16lh), recompute counted) and T = compute + exposed
  TP/DP/P_a/offload communication (``perf_model.step_time``).
* ``measured`` at paper scale: with a GPU cluster (``cluster.device=cuda``) the same setups are
  planned as real points for ``zero_repro.lab.launcher.run_training`` (each its own Slurm job under
  ``launcher=slurm``).
* ``measured`` locally: a scaled-down analogue on CPU ranks (gloo), defined by each figure's
  module; the ``hardware`` column says what it ran on.

A ``calibration`` point writes the fitted values and the fit error to ``results/calibration/``
(``calibrate.write_calibration``; the one file side effect of a run_point here: the calibration
is shared by the four figures).

Batch per GPU of the simulated points, one series each (``experiment.params.batch_series``):
``max_fit`` -- the predicted batch: the largest on ``maxsize.BATCH_GRID`` whose memory dry run
under ``max_fit_stack`` (paper2020: the 2020 DeepSpeed + Megatron stack) fits the simulated
cluster's device (``maxsize.max_batch``); a ZeRO point whose configuration the paper does not
state runs the fastest of ``unstated_configs`` (C4, C5 when MP > 1; C3 at MP 1), each at its
own largest batch -- and ``paper``, the batch of the paper's Tables 5-10 (the "paper batch"
series). Cluster-measured points take ``experiment.params.batch`` (paper | max_fit).
"""

"""An alias of the throughput figures' planner, which moved to ``zero_repro.lab.throughput``
(``setups``, ``batch``, ``plan``, ``simulate``, ``run``): kept only for the experiments that
still import it from here (``experiments/prediction_memory.py``); delete it once none does.
The layering test names it as the one figures module allowed to reach a planner.
"""
from __future__ import annotations

from zero_repro.lab.throughput.batch import (  # noqa: F401
    ABOVE, dryrun_config, largest_true, local_batch, local_budget, local_max_layers,
    max_fit_batch, max_fit_search, model_name_for_setup, paper_batch, paper_point_overrides)
from zero_repro.lab.throughput.plan import (  # noqa: F401
    calibration_point, candidate_configs, cluster_points, local_point, plan_points,
    simulated_points)
from zero_repro.lab.throughput.run import run_point  # noqa: F401
from zero_repro.lab.throughput.setups import (  # noqa: F401
    AGG_NAME, AGG_UNIT, DEFAULTS, PAPER_BATCH, PARAMS, UNIT, X_NAME, Y_NAME, figure_setups,
    find_setup, order_params, params)
from zero_repro.lab.throughput.simulate import (  # noqa: F401
    OVERLAP, in_sample, simulate, simulate_max_fit, zero_config_of)

"""Software-stack axis of the paper-scale dry run (``paper2020`` vs ``modern``); see
``switches`` for the switches and their sources, ``megatron2019`` for the 2019 layer,
``deepspeed02`` for the 2020 ZeRO-DP build and gradient path, ``categories`` for the
per-category breakdown."""

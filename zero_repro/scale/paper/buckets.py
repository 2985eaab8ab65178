"""The paper harness's constant fused-buffer sizes C_B (§6.2), in elements: reduce 5e8,
all-gather 2e8 (DeepSpeedExamples' Megatron-LM hyperscale scripts of the paper's runs,
``reduce_bucket_size`` / ``allgather_bucket_size``; inferred, REFERENCE.md). Stated once; the
paper-scale memory experiments, the throughput figures and the performance model read them.
"""
from __future__ import annotations

REDUCE_BUCKET = 500_000_000  # elements per gradient reduce(-scatter) bucket
ALLGATHER_BUCKET = 200_000_000  # elements per parameter all-gather bucket
PAPER_BUCKETS = {"zero.reduce_bucket_size": REDUCE_BUCKET,
                 "zero.allgather_bucket_size": ALLGATHER_BUCKET}

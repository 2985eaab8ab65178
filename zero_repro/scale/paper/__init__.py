"""The paper's facts, each stated once (arXiv:1910.02054): the reference numbers, the setups of
Tables 4-10, Table 1's formula, Table 3's ZeRO configurations C1-C5, bucket sizes. The bottom
layer: imports nothing from the project but ``zero_repro.config``."""

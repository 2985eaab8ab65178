"""GH200 Grace Hopper Superchip, 96 GB HBM3 (Hopper): 989 TFLOPS bf16 dense, 4000 GB/s HBM3, 132
SMs (NVIDIA GH200 Grace Hopper Superchip datasheet). Memory: datasheet 96 GB; no reported total
is cited (0: the datasheet size stands in). Kernel points: the abbreviations of
``zero_repro.scale.kernel_sources``; attention: the H100's (the generation's).
"""
from zero_repro.gpus import Gpu, Point

GPU = Gpu(
    "gh200", "GH200-96GB", "hopper", peak_tflops=989.0, hbm_gbps=4000.0, sm_count=132,
    memory_gb=96, cuda_name=(("GH200",), ()),
    points=(
        Point("gemm", (1024, 15360, 4096), 828.6, "MAMF (GH200 900 W, 141 GiB HBM3e)",
              "GH200 144GB", ref=989.0),
        Point("hbm", ("scale",), 3174.0, "RRZE gh200.txt"),
        Point("hbm", ("triad",), 3783.0, "RRZE gh200.txt"),
    ))

"""L40S-48GB (Ada): 362.05 TFLOPS bf16 dense (733 with sparsity), 864 GB/s GDDR6, 142 SMs (NVIDIA
L40S datasheet); no NVLink: the GPUs of a node talk over PCIe Gen4 x16. Memory: datasheet 48 GB;
no reported total is cited (0: the datasheet size stands in). Kernel points: the abbreviations
of ``zero_repro.scale.kernel_sources``.
"""
from zero_repro.gpus import Gpu, Point

GPU = Gpu(
    "l40s", "L40S-48GB", "ada", peak_tflops=362.05, hbm_gbps=864.0, sm_count=142,
    memory_gb=48, cuda_name=(("L40S",), ()), nvlink=False,
    points=(
        Point("gemm", (8192, 8192, 8192), 269.15, "TPD (L40S, bf16, best square size)"),
        Point("gemm", (8192, 8192, 8192), 264.02, "TPD (L40S, fp16, best square size)"),
        Point("hbm", ("scale",), 800.0, "RRZE l40.txt (L40: the L40S's 864 GB/s GDDR6)",
              "L40", ref=864.0),
        Point("hbm", ("triad",), 831.0, "RRZE l40.txt", "L40", ref=864.0),
    ))

"""Tesla V100-SXM2/3 32GB (Volta): 125 TFLOPS fp16 tensor peak, 900 GB/s HBM2, 80 SMs (NVIDIA
Tesla V100 datasheet; V100 architecture whitepaper). Memory: datasheet 32 GB HBM2 (DGX-2
datasheet: 512 GB = 16 x 32 GB); the device reports 32510 MiB total (nvidia-smi on a Tesla
V100-SXM3-32GB, driver 470.57.02: github zkcpku/alpaca-lora README.md; the V100-SXM2-32GB reports
the same): 258 MiB of the 32 GiB are kept by the driver. PyTorch's "total capacity"
(cudaMemGetInfo) on a V100 32GB: 31.74 GiB (liucongg/ChatGLM-Finetuning#73). Kernel points:
the abbreviations of ``zero_repro.scale.kernel_sources``.
"""
from zero_repro.gpus import Gpu, Point

GPU = Gpu(
    "v100", "Tesla V100-SXM 32GB", "volta", peak_tflops=125.0, hbm_gbps=900.0, sm_count=80,
    memory_gb=32, memory_mib=32510, cuda_name=(("V100", "32GB"), ("PCIE",)),
    points=(
        Point("gemm", (8192, 8192, 8192), 94.84, "TPD (V100-SXM2-16GB fp16, torch 2.7.1)"),
        Point("gemm", (8192, 8192, 8192), 88.92, "TPD (V100S-32GB PCIe fp16; its fraction "
              "of its own 130 TFLOPS peak stands in)", "V100S", ref=130.0),
        Point("hbm", ("scale",), 809.0, "RRZE v100.txt"),
        Point("hbm", ("triad",), 788.0, "RRZE v100.txt"),
    ))

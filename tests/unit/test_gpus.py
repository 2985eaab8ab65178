"""Each GPU's facts have one home (zero_repro/gpus/<key>.py): the clusters name their GPU and
take its datasheet facts from there, repeating none of them; the package finds every GPU module;
a GPU's generation is a field checked against the known generations; an unknown GPU is refused
with an error naming the known ones, wherever it is named."""
from __future__ import annotations

import sys

import pytest
import yaml

from zero_repro import config as C
from zero_repro import gpus
from zero_repro.scale import kernels as K
from zero_repro.scale.kernel_sources import KERNEL_START_S
from zero_repro.scale import outside_modern
from zero_repro.scale.paper.clusters import list_clusters, load_cluster

from tests import ROOT


def test_every_gpu_module_is_found_under_its_key():
    files = {p.stem for p in (ROOT / "zero_repro" / "gpus").glob("*.py")} - {"__init__"}
    assert set(gpus.known()) == files
    assert all(g.key == k for k, g in gpus.known().items())


@pytest.mark.parametrize("cluster", [c for c in list_clusters() if c != "local"])
def test_a_cluster_names_its_gpu_and_repeats_none_of_its_facts(cluster):
    raw = yaml.safe_load((ROOT / "conf" / "cluster" / f"{cluster}.yaml").read_text())
    assert raw.get("gpu") in gpus.known()
    assert not set(raw) & set(C.GPU_FIELDS), "a GPU fact written twice"
    c, g = load_cluster(cluster), gpus.gpu(raw["gpu"])
    assert [getattr(c, f) for f in C.GPU_FIELDS] == [getattr(g, f) for f in
                                                     C.GPU_FIELDS.values()]


def test_an_explicit_value_is_a_what_if_and_stays():
    c = C.ClusterConfig(name="x", device="cuda", backend="nccl", gpu="h100_sxm",
                        peak_tflops=500.0)
    assert c.peak_tflops == 500.0 and c.hbm_gbps == 3350.0 and c.device_memory_mib == 81559


def test_unknown_gpu_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown GPU 'b200': use one of \[.*'h100_sxm'"):
        C.ClusterConfig(name="x", device="cuda", backend="nccl", gpu="b200")
    with pytest.raises(ValueError, match="unknown GPU 'b200'"):
        K.device_kernels("b200")
    with pytest.raises(ValueError, match="unknown GPU 'b200'"):
        K.device_for("h100", "b200")


def test_generation_is_a_field_checked_not_a_name_matched():
    with pytest.raises(ValueError, match="generation 'blackwell' is not one of"):
        gpus.Gpu("b200", "B200", "blackwell", 2250.0, 8000.0, 148, 180)
    # what the generation decides is read from it: NVLS buffers on Hopper only, by its field
    h100, a100 = gpus.gpu("h100_sxm"), gpus.gpu("a100_80gb")
    assert "nvls" in outside_modern.bracket(h100.gen, 1, 8)["parts"]
    assert "nvls" not in outside_modern.bracket(a100.gen, 1, 8)["parts"]
    # a Hopper board on PCIe (no NVSwitch) keeps no NVLink SHARP buffers
    assert "nvls" not in outside_modern.bracket(h100.gen, 1, 8, nvlink=False)["parts"]
    assert K.device_kernels("h200_sxm").attn[("fwd", False)].proxy == "h100_sxm"
    assert K.intra_link(K.device_kernels("l40s")) == "pcie"


def test_a_gpu_without_a_gemm_point_is_refused_with_the_file_to_fix():
    g = gpus.Gpu("x100", "X100", "ampere", 300.0, 2000.0, 100, 80)
    with pytest.raises(ValueError, match="no gemm point.*zero_repro/gpus/x100.py"):
        K._points_band(g, "gemm")


def test_the_worked_example_adds_a_gpu_kind_in_one_file(tmp_path, monkeypatch):
    """docs/estimate.md's worked example: its module, the only new file (in a folder added to
    the package's path), is found under its key, fills a cluster with its facts and gives a
    kernel model; before it exists the key is refused."""
    text = (ROOT / "docs" / "estimate.md").read_text()
    head = "```python\n# zero_repro/gpus/h100_pcie.py\n"
    code = text.split(head, 1)[1].split("```", 1)[0]
    with pytest.raises(ValueError, match="unknown GPU 'h100_pcie'"):
        gpus.gpu("h100_pcie")
    (tmp_path / "h100_pcie.py").write_text(code)
    monkeypatch.setattr(gpus, "__path__", [*gpus.__path__, str(tmp_path)])
    gpus.known.cache_clear()
    try:
        g = gpus.gpu("h100_pcie")
        c = C.ClusterConfig(name="x", device="cuda", backend="nccl", gpu="h100_pcie")
        assert [getattr(c, f) for f in C.GPU_FIELDS] == [getattr(g, f) for f in
                                                         C.GPU_FIELDS.values()]
        dk = K.device_kernels("h100_pcie")
        assert K.intra_link(dk) == "pcie" and g.gen.name == "hopper"
        # the SXM part's GEMM point stands in at its efficiency (794.5 of 989 TFLOPS)
        t = K.gemm_seconds(dk, g.peak_tflops * 1e12, g.hbm_gbps * 1e9, 4096, 4096, 4096)
        assert t - KERNEL_START_S == pytest.approx(2 * 4096**3 / (756e12 * 794.5 / 989))
    finally:
        gpus.known.cache_clear()
        sys.modules.pop(f"{gpus.__name__}.h100_pcie", None)

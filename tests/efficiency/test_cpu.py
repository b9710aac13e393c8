"""The CPU a figure was measured on: its model name and the matrix features that decide bf16's and int8's speed."""

from __future__ import annotations

from vlfit.efficiency import cpu


def test_the_model_and_matrix_features_are_read_from_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t\t: fpu avx2 avx512f avx512_vnni amx_tile amx_bf16 amx_int8 avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: another\nflags\t\t: fpu\n"
    )
    model, flags = cpu._read_cpuinfo(str(path))
    info = cpu.CpuInfo(model, "AVX512", tuple(f for f in cpu.MATRIX_FEATURES if f in flags))
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert info.features == ("amx_bf16", "amx_int8", "avx512_vnni", "avx512_bf16", "avx512f", "avx2")
    assert info.has_amx_bf16 and info.has_amx_int8 and info.has_vnni
    assert info.describe() == (
        "Intel(R) Xeon(R) Platinum 8480+ (torch AVX512; amx_bf16, amx_int8, avx512_vnni, avx512_bf16, avx512f, avx2)"
    )
    assert info.record() == {"cpu": model, "cpu_capability": "AVX512", "cpu_features": list(info.features)}


def test_a_cpu_without_the_features_says_which_it_lacks(tmp_path):
    missing = cpu._read_cpuinfo(str(tmp_path / "none"))  # not Linux, or no /proc
    assert missing == ("", set())
    bare = cpu.CpuInfo("Apple M2", "DEFAULT", ())
    assert not (bare.has_amx_bf16 or bare.has_vnni)
    assert bare.describe() == "Apple M2 (torch DEFAULT; none of amx_bf16, amx_int8, avx512_vnni, avx_vnni)"


def test_this_machine_is_named_with_torch_s_capability():
    import torch

    info = cpu.cpu_info()
    assert info.model and info.capability == torch.backends.cpu.get_cpu_capability()
    assert set(info.features) <= set(cpu.MATRIX_FEATURES)

"""The package as a user installs it: a regular (non-editable) wheel, in a fresh virtual environment
outside the checkout, JIT-builds and runs the fused kernels from the sources it carries."""
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = textwrap.dedent("""
    import os, sys, torch
    import deepspeed_acco
    from deepspeed_acco import ops
    from deepspeed_acco.op_builder.builder import CSRC_DIR
    location = os.path.dirname(deepspeed_acco.__file__)
    assert location.startswith(sys.prefix), f"imported {location}, not the wheel in {sys.prefix}"
    assert str(CSRC_DIR).startswith(location), f"kernel sources from {CSRC_DIR}, not from the wheel"
    assert ops.backend("cpu") == "cpu", "the fused CPU kernels did not build from the packaged sources"
    gen = torch.Generator().manual_seed(0)
    param, grad, m, v = (torch.randn(4099, generator=gen) for _ in range(4))
    v = v.abs()
    ref = [t.clone() for t in (param, m, v)]
    hyper = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    ops.adamw_step(param, grad, m, v, **hyper)
    ops.reference.adamw_step(ref[0], grad, ref[1], ref[2], **hyper)
    # Within 1e-6 of the tensor's magnitude, the rule of tests/test_ops_kernels.py: the fused
    # kernel gives the same bits on every x86 ISA, but torch's fp32 reference does not (its sqrt,
    # lerp and addcdiv take different vector paths on different CPUs), and where theta * decay
    # nearly cancels the update, one last bit of the operands is many ulps of the result.
    scale = ref[0].abs().max().item()
    worst = (param - ref[0]).abs().argmax()
    assert torch.allclose(param, ref[0], rtol=1e-6, atol=1e-6 * scale), (
        f"element {worst.item()}: fused {param[worst].item()!r}, reference {ref[0][worst].item()!r}, "
        f"scale {scale!r}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("wheel ok:", location, CSRC_DIR)
""")


@pytest.mark.slow
def test_wheel_installs_outside_the_checkout_and_builds_the_kernels(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(dist), REPO], check=True, cwd=tmp_path)
    wheels = list(dist.glob("deepspeed_acco-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as archive:
        names = archive.namelist()
    for source in ("cpu/acco_cpu_kernels.cpp", "cpu/acco_cpu_frontend.cpp", "cuda/acco_cuda_kernels.cu",
                   "includes/acco_coeffs.h"):
        assert f"deepspeed_acco/_csrc/{source}" in names, f"{source} is not in the wheel"

    # A fresh environment: its own site-packages with the wheel, and this one's dependencies
    # (torch, deepspeed) behind it; the checkout is not on its path.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
    with open(os.path.join(site, "dependencies.pth"), "w") as handle:
        handle.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site, str(wheels[0])],
                   check=True)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "DEEPSPEED_ACCO_KERNELS")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")  # a fresh JIT build
    result = subprocess.run([str(python), "-c", CHECK], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "wheel ok" in result.stdout

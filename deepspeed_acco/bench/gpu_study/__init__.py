"""The prepared GPU study (benchmarks/gpu_study.sh, docs/gpu_study.md): overlap against an emulated
link, and convergence at 125M."""

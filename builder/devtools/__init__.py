"""Developer tools: GPU checks, test checkpoints and the bundled model's trainer (not used by a build).

    gpu_suite.sh      on a GPU machine: kernel checks, CUDA-vs-CPU agreement, GPU calibration, 8B benchmarks
    check_kernels.py  an artifact's linears on the Triton kernels against the torch references
    cuda_smoke.py     the bundled artifacts on the CUDA serving path against the CPU path
    tp_check.py       a tensor-parallel artifact against its one-rank build
    make_checkpoint.py  a random checkpoint of a real model's shape (Llama-3-8B), no download
    train_bundled.py  trains the bundled model (models/pystdlib-llama) and writes its records
"""

"""Check an artifact on CUDA: the executor on the Triton/cuBLASLt kernels against its torch reference ops.

    python -m builder.devtools.check_kernels artifacts/llama3-8b-fp8 [--tokens 32]
    python -m builder.devtools.check_kernels --fp8-linear --fp8-block-linear
    python -m builder.devtools.check_kernels artifacts/quickstart-fp8 --fast-accum --reference artifacts/quickstart \
        --text models/pystdlib-llama/eval.txt

Loads the artifact twice on the GPU (``use_kernels`` on and off), runs the same fresh random prompt
through both and prints the max absolute and relative logit difference and the top-1 agreement. The flags check
single linears at real shapes instead (error against the reference, time against bf16), the kernel path with and
without its cross-node fusions (``--fusions``), or what fast FP8 accumulation changes (``--fast-accum``).
"""

from __future__ import annotations

import argparse
import json

import torch

from runtime import Engine


def check_fp8_linear(shapes=((1, 4096, 6144), (16, 4096, 28672), (256, 14336, 4096))) -> None:
    """The _scaled_mm FP8 linear against the reference FP8 linear on fresh random bf16 inputs, and its time
    against a bf16 F.linear of the same shape."""
    from kernels.torch_quant import make_fp8_scaled_mm_linear, make_quant_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in shapes:
        w = torch.randn(n, k, generator=g, device="cuda") * 0.02
        scale = w.abs().amax(1, keepdim=True) / 448.0
        weights = {"qweight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(-1)}
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        fast = make_fp8_scaled_mm_linear(weights)
        ref = make_quant_linear("fp8", weights, {}, torch.bfloat16)
        got, want = fast(x).float(), ref(x).float()
        wb = w.to(torch.bfloat16)
        print(json.dumps({"fp8_linear": [m, k, n], "rel_err": ((got - want).abs().max() / want.abs().max()).item(),
                          "scaled_mm_us": _time_us(lambda: fast(x)),
                          "bf16_us": _time_us(lambda: torch.nn.functional.linear(x, wb))}))


def check_fp8_block_linear(shapes=((1, 4096, 6144), (2, 4096, 6144), (4, 4096, 6144), (16, 4096, 24576),
                                   (256, 12288, 4096), (1, 7168, 2112), (4, 7168, 2112), (33, 4000, 1000))) -> None:
    """``kernels.fp8_block_gemm`` (128 x 128 blocks; the GEMV at few rows, the GEMM above) against the reference
    fp8_block linear on fresh random bf16 inputs and block scales (the last shape ends in partial blocks along N and
    K), and its time against a bf16 F.linear of the same shape: back-to-back calls (``kernel_us``, ``bf16_us``: the
    Python launch included, so the few-row times are bound by the host) and CUDA-graph replays (``*_graph_us``: the
    GPU's time alone; weights not rotated, see ``python -m kernels.bench.fp8_block`` for HBM-bound timings)."""
    from kernels.bench.gemm import time_us
    from kernels.fp8_block_gemm import fp8_block_linear, ref_fp8_block_linear
    from kernels.torch_quant import dequantize_weight_fp8_blocks

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in shapes:
        codes = (torch.randn(n, k, generator=g, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.rand(-(-n // 128), -(-k // 128), generator=g, device="cuda") * 1e-4 + 1e-5
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        got = fp8_block_linear(x, codes, scales, (128, 128)).float()
        want = ref_fp8_block_linear(x, codes, scales, (128, 128)).float()
        wb = dequantize_weight_fp8_blocks(codes, scales, (128, 128)).to(torch.bfloat16)
        rel_err = ((got - want).abs().max() / want.abs().max()).item()

        def kernel():
            return fp8_block_linear(x, codes, scales, (128, 128))

        def bf16():
            return torch.nn.functional.linear(x, wb)

        print(json.dumps({"fp8_block_linear": [m, k, n], "rel_err": rel_err,
                          "kernel_us": _time_us(kernel), "bf16_us": _time_us(bf16),
                          "kernel_graph_us": round(time_us([kernel]), 1), "bf16_graph_us": round(time_us([bf16]), 1)}))


def _time_us(fn, repeats: int = 50) -> float:
    """Mean CUDA time of ``fn`` in microseconds, after three warm-up calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / repeats * 1e3, 1)


def check_fusions(path: str, lengths=(1, 5, 12, 32, 80, 130), tokens: int = 24) -> None:
    """The kernel path with and without the cross-node fusions that change which kernel does what (the SwiGLU in
    the gate/up linear, the residual-add + RMSNorm split across the frag linears around it, the norms and the SwiGLU
    quantizing for the W8A8 linear they feed), on fresh random prompts of ``lengths`` tokens (1-32 rows: the frag
    kernel's batch-tile counts; 80 and 130: the GEMM and cuBLAS paths, where the gate/up output is read in its
    interleaved order) and a greedy generation of ``tokens`` (the decode steps): prints the logit differences, top-1
    agreement and whether the generated tokens are equal."""
    from runtime import SamplingParams, executor

    results = {}
    flags = ("FUSE_SWIGLU", "FUSE_NORM_INTO_LINEARS", "FUSE_NORM_QUANT")
    for on in (True, False):
        saved = {f: getattr(executor, f) for f in flags}
        for f in flags:
            setattr(executor, f, on)
        try:
            engine = Engine.load(path, "cuda", check_hashes=False, use_kernels=True, allow_failed_gate=True)
        finally:
            for f, v in saved.items():
                setattr(executor, f, v)
        fusions = engine.executor._fusions
        vocab = int(engine.executor.graph["meta"]["vocab_size"])
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
        results[on] = {"planned": [len(fusions.swiglu_out), len(fusions.residual_out), len(fusions.quant_producers)],
                       "logits": [engine.logits(p).float().cpu() for p in prompts],
                       "tokens": engine.generate(prompts[-1], SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                             ignore_eos=True)).token_ids}
        del engine
        torch.cuda.empty_cache()
    for n, got, want in zip(lengths, results[True]["logits"], results[False]["logits"]):
        diff = (got - want).abs().max().item()
        print(json.dumps({"fusions": path, "rows": n, "planned (swiglu, residual, quant)": results[True]["planned"],
                          "max_abs_diff": diff, "rel": diff / want.abs().max().item(),
                          "top1_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}))
    print(json.dumps({"fusions": path, "greedy_tokens_equal": results[True]["tokens"] == results[False]["tokens"],
                      "tokens": len(results[True]["tokens"])}))


def _load_with_accumulation(path: str, fast: bool | None) -> Engine:
    """The artifact on CUDA with its kernels, its FP8 GEMMs accumulating fast (True), promoted (False) or as the
    artifact says (None): RUNTIME_FP8_FAST_ACCUM for the load (each linear takes it when the executor is built)."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ):  # the process's environment as it was, afterwards
        os.environ.pop("RUNTIME_FP8_FAST_ACCUM", None)
        if fast is not None:
            os.environ["RUNTIME_FP8_FAST_ACCUM"] = "1" if fast else "0"
        return Engine.load(path, "cuda", check_hashes=False, use_kernels=True, allow_failed_gate=True)


def _windows(engine: Engine, text: str | None, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens: consecutive stretches of ``text`` (a file), else fresh random ids."""
    if text:
        with open(text, encoding="utf-8") as f:
            ids = engine.tokenizer.encode(f.read(), add_special_tokens=False)  # as the gates' windows
        if len(ids) < count * length:
            raise SystemExit(f"{text}: {len(ids)} tokens, fewer than {count} windows of {length}")
        step = len(ids) // count
        return [ids[i * step:i * step + length] for i in range(count)]
    vocab = int(engine.executor.graph["meta"]["vocab_size"])
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def check_fast_accum(path: str, reference: str | None = None, text: str | None = None, windows: int = 8,
                     length: int = 256) -> None:
    """What fast FP8 accumulation (``runtime.fp8_accumulation: fast``) changes, on the GPU, where it runs: the
    artifact's logits over ``windows`` windows of ``length`` tokens (prefill rows: cuBLAS's FP8 GEMMs) with its GEMMs
    promoted and fast. Prints KL(promoted || fast) per position, their top-1 agreement and the largest log-probability
    difference; with ``reference`` (the unquantized model's artifact) each one's KL from it and top-1 agreement with
    it, on the gates' metric (``builder.gates._kl_rows``; for a trained model, ``text``: the gates' evaluation text)."""
    from builder.gates import _kl_rows
    from runtime.executor import fp8_cublas_min_rows

    rows = fp8_cublas_min_rows()
    if length < rows:
        raise SystemExit(f"--window-len {length}: FP8 GEMMs run on cuBLAS (where fast accumulation applies) from "
                         f"{rows} rows; take at least {rows}")
    logits: dict[str, list[torch.Tensor]] = {}
    ids: list[list[int]] = []
    for name, fast in (("promoted", False), ("fast", True), ("reference", None)):
        where = reference if name == "reference" else path
        if where is None:
            continue
        engine = _load_with_accumulation(where, fast)
        if engine.limits.max_num_tokens < rows:
            raise SystemExit(f"{where}: runtime.max_num_tokens {engine.limits.max_num_tokens} feeds fewer than the "
                             f"{rows} rows that reach cuBLAS's FP8 GEMMs")
        if not ids:
            ids = _windows(engine, text, windows, length)
        logits[name] = [engine.logits(w).float().cpu().log_softmax(-1) for w in ids]
        engine.close()
        del engine
        torch.cuda.empty_cache()
    rows = {name: torch.cat(lp) for name, lp in logits.items()}
    p, f = rows["promoted"], rows["fast"]
    out = {"fast_accum": path, "positions": p.shape[0], "text": text or "random ids",
           "kl_promoted_fast": _kl_rows(p, f).mean().item(),
           "top1_promoted_fast": (p.argmax(-1) == f.argmax(-1)).float().mean().item(),
           "max_logprob_diff": (p - f).abs().max().item()}
    if "reference" in rows:
        r = rows["reference"]
        for name in ("promoted", "fast"):
            out[f"kl_reference_{name}"] = _kl_rows(r, rows[name]).mean().item()
            out[f"top1_reference_{name}"] = (r.argmax(-1) == rows[name].argmax(-1)).float().mean().item()
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--fp8-linear", action="store_true", help="check the FP8 linear alone")
    parser.add_argument("--fp8-block-linear", action="store_true",
                        help="check the block-scaled FP8 (fine-grained FP8) linear alone")
    parser.add_argument("--fusions", action="store_true",
                        help="compare the kernel path with and without the cross-node fusions instead")
    parser.add_argument("--fast-accum", action="store_true",
                        help="what fast FP8 accumulation changes (runtime.fp8_accumulation: fast) instead")
    parser.add_argument("--reference", help="--fast-accum: the unquantized model's artifact, to score both against")
    parser.add_argument("--text", help="--fast-accum: windows of this text (the gates' evaluation text) instead of "
                        "random ids")
    parser.add_argument("--windows", type=int, default=8, help="--fast-accum: how many windows")
    parser.add_argument("--window-len", type=int, default=256, help="--fast-accum: tokens per window")
    args = parser.parse_args(argv)
    if args.fast_accum and not args.artifact:
        parser.error("--fast-accum needs an FP8 artifact")
    if args.artifact and args.fast_accum:
        check_fast_accum(args.artifact, args.reference, args.text, args.windows, args.window_len)
        return 0
    if args.fp8_linear:
        check_fp8_linear()
    if args.fp8_block_linear:
        check_fp8_block_linear()
    if args.artifact and args.fusions:
        check_fusions(args.artifact)
        return 0
    if not args.artifact:
        return 0
    fused = Engine.load(args.artifact, "cuda", check_hashes=False, use_kernels=True, allow_failed_gate=True)
    vocab = int(fused.executor.graph["meta"]["vocab_size"])
    ids = torch.randint(3, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    got = fused.logits(ids).float().cpu()
    del fused
    torch.cuda.empty_cache()
    ref = Engine.load(args.artifact, "cuda", check_hashes=False, use_kernels=False, allow_failed_gate=True)
    want = ref.logits(ids).float().cpu()
    diff = (got - want).abs().max().item()
    print(json.dumps({"artifact": args.artifact, "max_abs_diff": diff, "rel": diff / want.abs().max().item(),
                      "top1_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What speculative decoding buys at batch 1, and what a verify step costs.

    python -m builder.bench.speculative ARTIFACT [--device auto|cpu|cuda] [--num-draft K] [--output-len 128]
        [--prompts 4] [--rounds 3] [--min-gain G] [--verify-cost 1 2 4 8] [--input-len 128] [--record FILE] [--tag NAME]
        [--draft DRAFT_ARTIFACT | --eagle EAGLE_HEAD_DIR] [--text FILE] [--ngram-sweep MIN:MAX:K ... [--cost C]]

Speedup (n-gram, the request's own tokens as the draft source): a code-editing workload, each prompt a stretch
of this project's own Python source followed by an instruction to write it out again and the stretch's first
line, so a model that copies finds its continuation in the prompt. Each prompt is decoded greedily at batch 1
(EOS ignored, --output-len tokens) by an engine without speculation and by one with ``--num-draft`` n-gram drafts
(adaptive, as served; default the runtime's: 12 for n-gram, 4 for a draft model).
Both engines are loaded side by side and take turns, prompt by prompt, over
``--rounds`` rounds (the first of each pair alternating), so that a drift in the host's speed (a shared machine's
CPU; at batch 1 a small model's step is host time) weighs on both alike. Decode rate: the tokens after the first
over the time from the first token to the last, summed over the prompts and rounds; the speedup is the speculative
rate over the plain one, and each round's speedup is printed to show the spread. The speculative engine's rate check
(``min_gain``, which turns drafts off where they measure slower) is off unless ``--min-gain`` is given: the figure is
what the drafts do; with ``--min-gain 1`` it is what a served engine does with them (the share of steps that
verified drafts is printed). The token ids of both runs are compared (greedy: they must be equal; a
differing prompt is reported, as bf16 near-ties can differ with the batch shape) and the acceptance printed.

Draft model (``--draft``): the same comparison with ``--num-draft`` tokens from a draft artifact (same tokenizer)
in place of n-gram lookup; EAGLE head (``--eagle``): the same with an EAGLE-1 head's checkpoint (runtime.eagle).
Either runs on the code-editing prompts or, with ``--text``, on ``--prompts`` stretches of ``--input-len`` tokens
taken evenly from a text file (held-out text: what a draft distilled from the model is for).

Verify cost (``--verify-cost K...``): random prompts of --input-len tokens, batch 1; the median step time with K
draft tokens fed at every step (a proposer that always proposes K copies of the last token, nearly all
rejected: the figure is the cost of a step scoring K + 1 tokens, not a speedup) over the median decode step
without speculation (overlapped, CUDA graphs on CUDA, as served). Verify steps run on the synchronous path.

N-gram settings (``--ngram-sweep MIN:MAX:K ...``): each setting's n-gram engine decodes the prompts once (greedy,
one pass, no timing), beside one plain pass; printed per setting: the steps, the verify steps among them, tokens
accepted per verify and the acceptance, and the speedup those counts give where a verify step costs ``--cost`` plain
steps (default 2.0: the bundled model's measured verify cost on the H100, ``spec_verify_cost_k*_bundled``; about
1.1 for the 8B shape): plain steps / (speculative steps + (cost - 1) x verify steps). Counts, not times: a way to
choose settings on any machine, the GPU's figure still to be measured.

Figures (``--record``): spec_speedup_ngram_b1{tag} (x), spec_decode_tok_s_plain_b1{tag} and
spec_decode_tok_s_ngram_b1{tag} (tok/s), spec_acceptance_ngram_b1{tag} (accepted / proposed drafts),
spec_verify_cost_k{K}{tag} (x) with spec_step_ms_k{K}{tag} and spec_step_ms_k0{tag} (ms); with ``--draft``,
spec_speedup_draft_b1{tag} (x), spec_decode_tok_s_draft_b1{tag} (tok/s), spec_acceptance_draft_b1{tag} (ratio) and
spec_accepted_per_verify_draft_b1{tag} (tokens); with ``--eagle`` the same names with ``eagle`` for ``draft``
(``eagle3`` for an EAGLE-3 head).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from builder.bench.offline import _random_prompts
from builder.bench.record import append_figures
from runtime.artifact import open_artifact, read_manifest
from runtime.eagle import head_version
from runtime.engine import resolve_device
from runtime.sampling import SamplingParams
from runtime.serving import ServingConfig, ServingEngine
from runtime.speculative import DEFAULT_SPECULATIVE_TOKENS, DraftRequest, Proposer, SpeculativeConfig
from runtime.tokenizer import Tokenizer

SOURCES = ("runtime/scheduler.py", "runtime/block_pool.py", "runtime/sampling.py", "runtime/kv_manager.py",
           "builder/bench/offline.py", "runtime/metrics.py")
SNIPPET_LINES = 24


def code_edit_prompts(tokenizer: Tokenizer, num: int, root: Path) -> list[list[int]]:
    """``num`` prompts: a stretch of SNIPPET_LINES lines of this project's source, an instruction to write it out
    again, and its first line (module docstring)."""
    prompts = []
    for i in range(num):
        lines = (root / SOURCES[i % len(SOURCES)]).read_text().splitlines()
        start = min(40 + 17 * (i // len(SOURCES)), max(len(lines) - SNIPPET_LINES, 0))
        while start < len(lines) - 1 and not lines[start].strip():  # the cue is the stretch's first line: not a blank
            start += 1
        snippet = "\n".join(lines[start: start + SNIPPET_LINES])
        text = f"{snippet}\n\n# The code above, written out again unchanged:\n{lines[start]}\n"
        prompts.append(tokenizer.encode(text))
    return prompts


def text_prompts(tokenizer: Tokenizer, num: int, length: int, path: Path) -> list[list[int]]:
    """``num`` prompts of ``length`` tokens, cut at evenly spaced places of the text file at ``path``."""
    ids = tokenizer.encode(path.read_text())
    if len(ids) < num * length:
        raise ValueError(f"{path} holds {len(ids)} tokens, fewer than {num} prompts of {length}")
    step = (len(ids) - length) // max(num - 1, 1)
    return [ids[i * step: i * step + length] for i in range(num)]


def _generate(engine: ServingEngine, prompt: list[int], output_len: int) -> tuple[list[int], float]:
    """Greedy tokens of one request alone, and the seconds from its first token to its last."""
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    first = last = None
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if out.token_ids:
                now = time.perf_counter()
                if first is None:
                    first = now
                last = now
                tokens += out.token_ids
    return tokens, (last - first) if first is not None and last is not None else 0.0


def _load(path: str, device: str, speculative: SpeculativeConfig | None) -> ServingEngine:
    # a small KV pool (batch 1): the engines are loaded one after the other, and a closed one's pool may linger
    # (None: plain, whatever the artifact's recipe says)
    return ServingEngine.load(path, device, ServingConfig(max_num_seqs=8, num_blocks=512,
                                                          speculative=speculative or SpeculativeConfig()))


def speedup(path: str, device: str, num_draft: int | None, prompts: list[list[int]], output_len: int,
            draft: str | None = None, rounds: int = 3, min_gain: float = 0.0, method: str = "draft") -> dict:
    """Plain and speculative runs of every prompt, taking turns (see the module docstring): n-gram drafts, or the
    ``draft`` artifact's, or with ``method`` "eagle" the EAGLE head's at ``draft`` (the result's keys keep the n-gram
    names). ``min_gain``: the speculative engine's rate check (0, the default here: off, so that the figure is what
    the drafts do, not what the policy chose)."""
    method = {"method": "ngram"} if draft is None else {"method": method, "draft_model": draft}
    spec = SpeculativeConfig(**method, num_speculative_tokens=num_draft, min_gain=min_gain)  # None: the default
    engines = {"plain": _load(path, device, None), "ngram": _load(path, device, spec)}
    try:
        for engine in engines.values():
            _generate(engine, prompts[0], 8)  # warm up (kernels, graphs)
        tokens = {name: 0 for name in engines}
        seconds = {name: 0.0 for name in engines}
        per_round, differing = [], set()
        for r in range(rounds):
            got: dict[str, list[list[int]]] = {name: [] for name in engines}
            round_tokens, round_s = dict.fromkeys(engines, 0), dict.fromkeys(engines, 0.0)
            for i, prompt in enumerate(prompts):
                for name in (("plain", "ngram") if (r + i) % 2 == 0 else ("ngram", "plain")):
                    ids, secs = _generate(engines[name], prompt, output_len)
                    got[name].append(ids)
                    round_tokens[name] += len(ids) - 1
                    round_s[name] += secs
            differing |= {i for i, (a, b) in enumerate(zip(got["plain"], got["ngram"])) if a != b}
            per_round.append((round_tokens["ngram"] / round_s["ngram"]) / (round_tokens["plain"] / round_s["plain"]))
            for name in engines:
                tokens[name] += round_tokens[name]
                seconds[name] += round_s[name]
        stats = engines["ngram"].stats()
        verify_share = stats.spec_num_steps / max(stats.num_steps, 1)
    finally:
        for engine in engines.values():
            _close(engine)
    rate = {name: tokens[name] / seconds[name] for name in engines}
    return {"plain_tok_s": rate["plain"], "ngram_tok_s": rate["ngram"], "speedup": rate["ngram"] / rate["plain"],
            "speedup_rounds": per_round, "verify_share": verify_share, "acceptance": stats.spec_acceptance_rate,
            "accepted_per_verify": stats.spec_mean_accepted_tokens, "differing_prompts": sorted(differing)}


def ngram_sweep(path: str, device: str, settings: list[tuple[int, int, int]], prompts: list[list[int]],
                output_len: int, cost: float) -> list[dict]:
    """``--ngram-sweep``'s counts (the module docstring) for each (min_ngram, max_ngram, k)."""
    plain = _load(path, device, None)
    try:
        plain_tokens = [_generate(plain, p, output_len)[0] for p in prompts]
        plain_steps = plain.stats().num_steps
    finally:
        _close(plain)
    out = []
    for low, high, k in settings:
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, min_ngram=low, max_ngram=high, min_gain=0.0)
        engine = _load(path, device, spec)
        try:
            tokens = [_generate(engine, p, output_len)[0] for p in prompts]
            stats = engine.stats()
        finally:
            _close(engine)
        steps, verify = stats.num_steps, stats.spec_num_steps
        out.append({"min_ngram": low, "max_ngram": high, "k": k, "steps": steps, "verify_steps": verify,
                    "plain_steps": plain_steps, "accepted_per_verify": stats.spec_mean_accepted_tokens,
                    "acceptance": stats.spec_acceptance_rate, "tokens_equal": tokens == plain_tokens,
                    "estimated_speedup": plain_steps / (steps + (cost - 1.0) * verify)})
    return out


def _close(engine: ServingEngine) -> None:
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _RepeatProposer(Proposer):
    """Always proposes the request's last token, repeated: a verify step of fixed size (its cost, not a speedup)."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [[r.token_ids[-1]] * r.max_tokens for r in requests]


def _median_step_ms(engine: ServingEngine, prompt: list[int], output_len: int) -> float:
    """The median time between consecutive steps' tokens of one request (its first 3 and last steps left out)."""
    engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    ends = []
    while engine.has_unfinished:
        if engine.step():
            ends.append(time.perf_counter())
    gaps = [b - a for a, b in zip(ends, ends[1:])][3:-1]
    return 1e3 * statistics.median(gaps)


def verify_cost(path: str, device: str, ks: list[int], prompt: list[int], output_len: int) -> dict[int, float]:
    """Median step ms at batch 1 with K drafts per step, K = 0 (no speculation) and each of ``ks``."""
    out = {}
    for k in [0] + ks:
        spec = None if k == 0 else SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False,
                                                     min_acceptance=0.0)
        engine = _load(path, device, spec)
        if k:
            engine.proposer = _RepeatProposer()
        _median_step_ms(engine, prompt, 16)  # warm up
        out[k] = statistics.median(_median_step_ms(engine, prompt, output_len) for _ in range(3))
        _close(engine)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-draft", type=int, default=None,
                        help="most drafts per step (default: the runtime's, 12 for n-gram and 4 for a draft model)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the prompts, the engines taking turns")
    parser.add_argument("--min-gain", type=float, default=0.0,
                        help="the speculative engine's rate check (0: off, the drafts' own speedup; 1.0: as served)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--verify-cost", type=int, nargs="*", default=[])
    parser.add_argument("--no-speedup", action="store_true", help="only the verify cost")
    parser.add_argument("--record")
    parser.add_argument("--tag", default="", help="suffix of the recorded figures' names (e.g. _bundled)")
    parser.add_argument("--draft", help="a draft model's artifact: its speedup instead of n-gram lookup's")
    parser.add_argument("--eagle", help="an EAGLE head's checkpoint directory (runtime.eagle): its speedup instead")
    parser.add_argument("--text", help="prompts cut from this text file (default: the code-editing ones)")
    parser.add_argument("--ngram-sweep", nargs="+", metavar="MIN:MAX:K",
                        help="count the steps of these n-gram settings instead (module docstring)")
    parser.add_argument("--cost", type=float, default=2.0,
                        help="--ngram-sweep: a verify step's cost in plain steps (default 2.0: the bundled model's)")
    args = parser.parse_args(argv)
    if args.ngram_sweep:
        try:
            settings = [tuple(int(v) for v in s.split(":")) for s in args.ngram_sweep]
        except ValueError:
            settings = []
        if not settings or any(len(t) != 3 or not 1 <= t[0] <= t[1] or not 1 <= t[2] <= 16 for t in settings):
            parser.error(f"--ngram-sweep takes MIN:MAX:K triples with 1 <= MIN <= MAX and 1 <= K <= 16, got "
                         f"{' '.join(args.ngram_sweep)}")
        tokenizer = open_artifact(args.artifact, check_hashes=False).load_tokenizer()
        prompts = (text_prompts(tokenizer, args.prompts, args.input_len, Path(args.text)) if args.text else
                   code_edit_prompts(tokenizer, args.prompts, Path(__file__).resolve().parents[2]))
        for row in ngram_sweep(args.artifact, str(resolve_device(args.device)), settings, prompts, args.output_len,
                               args.cost):
            print(f"n-gram {row['min_ngram']}-{row['max_ngram']}, k={row['k']}: {row['steps']} steps "
                  f"({row['verify_steps']} verifying) against {row['plain_steps']} plain; accepted per verify "
                  f"{row['accepted_per_verify']:.2f}, acceptance {row['acceptance']:.2f}; estimated speedup at a "
                  f"verify cost of {args.cost}: {row['estimated_speedup']:.3f}x; tokens equal: {row['tokens_equal']}")
        return 0
    if args.prompts < 1 or args.output_len < 2 or args.rounds < 1:
        parser.error(f"--prompts and --rounds take 1 or more (got {args.prompts}, {args.rounds}) and --output-len 2 "
                     f"or more (got {args.output_len}): a rate needs tokens after the first")
    device = str(resolve_device(args.device))
    figures = []
    if not args.no_speedup:
        tokenizer = open_artifact(args.artifact, check_hashes=False).load_tokenizer()
        if args.text:
            prompts = text_prompts(tokenizer, args.prompts, args.input_len, Path(args.text))
        else:
            prompts = code_edit_prompts(tokenizer, args.prompts, Path(__file__).resolve().parents[2])
        if args.draft and args.eagle:
            parser.error("--draft and --eagle are two proposers: give one")
        res = speedup(args.artifact, device, args.num_draft, prompts, args.output_len, args.draft or args.eagle,
                      args.rounds, args.min_gain, method="eagle" if args.eagle else "draft")
        workload = "text" if args.text else "code-editing"
        name, label = (("eagle", f"EAGLE head {args.eagle}") if args.eagle else
                       ("draft", f"draft model {args.draft}") if args.draft else ("ngram", "n-gram"))
        k = args.num_draft or DEFAULT_SPECULATIVE_TOKENS[name]
        if args.eagle and head_version(args.eagle) == 3:  # its figures apart from an EAGLE-1 head's
            name, label = "eagle3", f"EAGLE-3 head {args.eagle}"
        print(f"{label} k={k}, batch 1, {len(prompts)} {workload} prompts, {args.output_len} tokens: "
              f"plain {res['plain_tok_s']:.1f} tok/s, speculative {res['ngram_tok_s']:.1f} tok/s, speedup "
              f"{res['speedup']:.2f}x (rounds: {', '.join(f'{x:.2f}' for x in res['speedup_rounds'])}; "
              f"{res['verify_share']:.0%} of steps verified drafts); "
              f"acceptance {res['acceptance']:.2f}, accepted per verify "
              f"{res['accepted_per_verify']:.2f}; prompts whose tokens differ: {res['differing_prompts'] or 'none'}")
        figures += [(f"spec_speedup_{name}_b1{args.tag}", res["speedup"], "x"),
                    (f"spec_decode_tok_s_plain_b1{args.tag}", res["plain_tok_s"], "tok/s"),
                    (f"spec_decode_tok_s_{name}_b1{args.tag}", res["ngram_tok_s"], "tok/s"),
                    (f"spec_acceptance_{name}_b1{args.tag}", res["acceptance"], "ratio")]
        if args.draft or args.eagle:
            figures.append((f"spec_accepted_per_verify_{name}_b1{args.tag}", res["accepted_per_verify"], "tokens"))
    if args.verify_cost:
        vocab = read_manifest(Path(args.artifact))["model"]["vocab_size"]
        prompt = _random_prompts(1, args.input_len, vocab, seed=0)[0]
        steps = verify_cost(args.artifact, device, args.verify_cost, prompt, args.output_len)
        base = steps[0]
        print(f"verify step, batch 1, {args.input_len}-token prompt: plain decode step {base:.3f} ms")
        figures.append((f"spec_step_ms_k0{args.tag}", base, "ms"))
        for k in args.verify_cost:
            print(f"  K = {k}: {steps[k]:.3f} ms = {steps[k] / base:.3f}x (break-even at "
                  f"{steps[k] / base - 1:.2f} accepted tokens per step)")
            figures += [(f"spec_verify_cost_k{k}{args.tag}", steps[k] / base, "x"),
                        (f"spec_step_ms_k{k}{args.tag}", steps[k], "ms")]
    if args.record and figures:
        append_figures(args.record, figures, device, "python -m builder.bench.speculative " + " ".join(argv or
                                                                                                         sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks: how fast an artifact runs, how a server holds up, how recipes compare.

    offline.py        `builder bench latency` / `throughput`: the serving engine in-process, with the
                      machine's copy bandwidth measured in the same run
    serve.py          `builder bench serve`: an HTTP load client for any OpenAI-compatible server
    hf_baseline.py    Hugging Face transformers' generate on the same checkpoint (eager or compiled)
    profile_step.py   where one serving step's GPU and host time goes (torch profiler)
    schedule_mix.py   the steps a throughput workload becomes (decode-only, mixed, prefill-only)
    quantizers.py     our quantization passes against an independent implementation, one metric code
"""

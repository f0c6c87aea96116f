"""One engine process of the single-flight end-to-end run (e2e.run_flight) and of the engines
bench's --flight (bench/engine_flight.py): greedy generation of N distinct long prompts,
started on a signal, to JSON.

    python -m e2e.flight_engine MODEL_DIR OUT.json --go GO_FILE [--segment UUID] [--extra JSON]
                                [--prompts N] [--words T] [--batched-tokens B] [--reverse]
                                [--warmup]

The engine starts, writes OUT.json.ready, waits (bounded) for GO_FILE to exist, then sends all
its prompts in one generate() call, so that two engines given the same GO_FILE start at the
same moment.  The JSON holds the token ids, each request's ``num_cached_tokens`` (vLLM's own:
tokens it did not compute, from its prefix cache or the connector) and first-token latency,
vLLM's prefix cache counters, the generate() time and its start and end on CLOCK_MONOTONIC,
every list in the prompts' own order (also with --reverse, which sends them last first).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

PROMPTS = 4
PROMPT_WORDS = 3000
MAX_TOKENS = 16
BLOCK_SIZE = 32
GO_WAIT = 900.0


def thread_layout(core: int) -> dict:
    """The environment that pins one engine's threads to ``core`` (with ``taskset -c core``):
    one OMP thread, bound there, none reserved.  Two engines on one host each get a core of
    their own so that neither one's threads wait on the other's (vLLM binds every engine to
    the same cores otherwise)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "OMP_NUM_THREADS": "1"}


def prompts(vocab_size: int, first_word_id: int, n: int, words: int) -> list[list[int]]:
    """n token-id prompts that share no block (fixed seed)."""
    rng = random.Random(39)
    ids = range(first_word_id, vocab_size)
    return [[rng.choice(ids) for _ in range(words)] for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--go", required=True, help="generate once this file exists")
    ap.add_argument("--segment", help="ucmcache segment uuid (no connector without it)")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config, as JSON")
    ap.add_argument("--prompts", type=int, default=PROMPTS)
    ap.add_argument("--words", type=int, default=PROMPT_WORDS)
    ap.add_argument("--batched-tokens", type=int, default=512)
    ap.add_argument("--reverse", action="store_true",
                    help="send the prompts last first (a router's other order; the report "
                         "lists every figure in the prompts' own order all the same)")
    ap.add_argument("--warmup", action="store_true",
                    help="one short generate() before OUT.json.ready (under one block: "
                         "nothing marked, saved or loaded), so no timed request pays the "
                         "first forward's one-time costs")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from e2e.engine import metric_totals

    kwargs = {}
    if a.segment:
        extra = {"segment": a.segment, "size_mb": 256, **json.loads(a.extra)}
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UcmCacheConnector", "kv_connector_module_path": "ucmcache.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}
    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=a.words + 64, block_size=BLOCK_SIZE, max_num_seqs=a.prompts,
              max_num_batched_tokens=a.batched_tokens, enable_chunked_prefill=True,
              disable_log_stats=False, **kwargs)
    tok = llm.get_tokenizer()
    first = max(tok.convert_tokens_to_ids(t) for t in ("<unk>", "<s>", "</s>", "<pad>")) + 1
    ps = prompts(len(tok), first, a.prompts, a.words)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    if a.warmup:
        llm.generate([TokensPrompt(prompt_token_ids=[first] * (BLOCK_SIZE // 2))],
                     SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
    with open(a.out + ".ready", "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + GO_WAIT
    while not os.path.exists(a.go):
        if time.monotonic() > deadline:
            raise SystemExit(f"e2e.flight_engine: {a.go} never appeared")
        time.sleep(0.01)   # waiting for the runner's signal file, not ordering our own steps
    print("e2e.flight_engine: go", flush=True)
    t1 = time.monotonic()
    order = list(reversed(range(len(ps)))) if a.reverse else list(range(len(ps)))
    sent = llm.generate([TokensPrompt(prompt_token_ids=ps[i]) for i in order], params,
                        use_tqdm=False)
    t2 = time.monotonic()
    gen = t2 - t1
    res = [None] * len(ps)
    for i, o in zip(order, sent):
        res[i] = o
    print("e2e.flight_engine: done", flush=True)
    report = {
        "outputs": [list(o.outputs[0].token_ids) for o in res],
        "cached": [int(o.num_cached_tokens or 0) for o in res],
        "ttft": [getattr(o.metrics, "first_token_latency", None) if o.metrics else None
                 for o in res],
        "metrics": metric_totals(llm), "generate_s": round(gen, 3),
        "prompt_tokens": sum(map(len, ps)), "pid": os.getpid(),
        # CLOCK_MONOTONIC is one clock for every process: a runner compares these to its own
        "t_go": t1, "t_done": t2, "order": order}
    with open(a.out + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(a.out + ".tmp", a.out)
    del llm


if __name__ == "__main__":
    main()

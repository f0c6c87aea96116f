"""One engine process of the end-to-end run: greedy generation of fixed prompts, to JSON.

    python -m e2e.engine MODEL_DIR OUT.json [--segment UUID] [--extra JSON] [--rounds N]

Without --segment the engine runs with no connector (the reference outputs); with it, under
ucmcache.vllm.UcmCacheConnector on that segment.  The prompts (token ids, so their lengths are
exact) share long prefixes: PREFIXES prefixes of PREFIX_WORDS words, each followed by SUFFIXES
different suffixes.  Requests go in `rounds` rounds, one generate() call each, so a kill lands
between or inside rounds.  The JSON holds the token ids, the engine's prefix cache counters
(vLLM's own metrics: `external_prefix_cache_hits` counts tokens loaded by the connector) and
the connector's stats as the engine reported them.  --preempt: each round's requests go
through the engine's own API, and as soon as the first token of the round is out (the prompts'
blocks computed, their saves handed to the save thread) every running request is preempted
(``reset_prefix_cache(reset_running_requests=True)``, vLLM's forced preemption): they resume
and finish after it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

PREFIXES = 2
PREFIX_WORDS = 700
SUFFIXES = 3
SUFFIX_WORDS = 45
MAX_TOKENS = 24
BLOCK_SIZE = 32


def prompts(vocab_size: int, first_word_id: int) -> list[list[int]]:
    """Token-id prompts: every prefix repeated under several suffixes (fixed seed)."""
    rng = random.Random(2024)
    ids = range(first_word_id, vocab_size)
    out = []
    for _ in range(PREFIXES):
        prefix = [rng.choice(ids) for _ in range(PREFIX_WORDS)]
        for _ in range(SUFFIXES):
            out.append(prefix + [rng.choice(ids) for _ in range(SUFFIX_WORDS)])
    return out


def metric_totals(llm) -> dict[str, float]:
    want = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
            "vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries",
            "vllm:num_preemptions")
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in want or m.name.startswith("vllm:ucmcache_"):  # ours: build_prom_metrics
            out[m.name.split(":", 1)[1]] = out.get(m.name.split(":", 1)[1], 0) + m.value
    return out


def generate_preempted(llm, r: int, batch: list[list[int]], params) -> list[list[int]]:
    """The round's outputs, every running request preempted once after its first token."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    params = params.clone()
    params.output_kind = RequestOutputKind.CUMULATIVE
    eng = llm.llm_engine
    ids = [f"r{r}-{i}" for i in range(len(batch))]
    for rid, p in zip(ids, batch):
        eng.add_request(rid, TokensPrompt(prompt_token_ids=p), params)
    done: dict[str, list[int]] = {}
    preempted = False
    deadline = time.monotonic() + 600
    while len(done) < len(ids) and time.monotonic() < deadline:
        for out in eng.step():
            if not preempted and out.outputs and out.outputs[0].token_ids:
                llm.reset_prefix_cache(reset_running_requests=True)
                preempted = True
                print(f"e2e.engine: round {r + 1}: running requests preempted", flush=True)
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    if len(done) < len(ids):
        raise SystemExit(f"e2e.engine: round {r + 1}: {len(ids) - len(done)} request(s) never "
                         f"finished")
    return [done[rid] for rid in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--segment", help="ucmcache segment uuid (no connector without it)")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config, as JSON")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--preempt", action="store_true",
                    help="preempt every running request once each round's first token is out")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if a.segment:
        extra = {"segment": a.segment, "size_mb": 64, **json.loads(a.extra)}
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UcmCacheConnector", "kv_connector_module_path": "ucmcache.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}
    t0 = time.monotonic()
    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=a.max_model_len, block_size=BLOCK_SIZE, max_num_seqs=4,
              disable_log_stats=False, **kwargs)
    started = time.monotonic() - t0
    tok = llm.get_tokenizer()
    first = max(tok.convert_tokens_to_ids(t) for t in ("<unk>", "<s>", "</s>", "<pad>")) + 1
    ps = prompts(len(tok), first)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs: list[list[int]] = []
    t1 = time.monotonic()
    per_round = -(-len(ps) // a.rounds)
    for r in range(a.rounds):
        batch = ps[r * per_round:(r + 1) * per_round]
        if a.preempt:
            outputs += generate_preempted(llm, r, batch, params)
        else:
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                               use_tqdm=False)
            outputs += [list(o.outputs[0].token_ids) for o in res]
        print(f"e2e.engine: round {r + 1}/{a.rounds} done", flush=True)
    gen = time.monotonic() - t1
    report = {"outputs": outputs, "metrics": metric_totals(llm), "startup_s": round(started, 1),
              "generate_s": round(gen, 2), "prompt_tokens": sum(map(len, ps)), "pid": os.getpid()}
    with open(a.out + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(a.out + ".tmp", a.out)  # the whole report or none: a killed run leaves nothing
    del llm


if __name__ == "__main__":
    main()

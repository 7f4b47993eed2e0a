"""Where a disaggregated answer and a plain instance's part: greedy tokens and top-5 logprobs compared.

Phase "pd": 1 prefill + 1 decode (our connector, vLLM's prefix cache off as in the store-routing e2e);
each prompt goes through the proxy (PD) and straight to decode without kv_transfer_params (plain vLLM
on the very same server: same cores, same threads). Phase "plain": one plain server (no connector),
started the way the store-routing e2e starts its baseline (LocalCluster, 1 server), optionally pinned
to one core (--plain-cores 0) so its thread count matches the PD servers'. Phase "compare" (no server)
prints, per prompt, every answer, and against PD the first token where two answers differ with the top-2
logprobs there, or the largest difference of the chosen tokens' logprobs when they all agree.
Run the server phases under the lock, one at a time (2 cores):
  flock /tmp/e2e.lock python benchmarks/pd_vs_plain_diff.py --phase pd --out /tmp/pd.json
  flock /tmp/e2e.lock python benchmarks/pd_vs_plain_diff.py --phase plain --out /tmp/plain.json
  python benchmarks/pd_vs_plain_diff.py --phase compare --out /tmp/pd.json /tmp/plain.json
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.test_router_e2e import ProxyThread, _model_dir
from tests.support.e2e_cluster import metric
from vllm_pd.router.cli.local_cluster import LocalCluster
from vllm_pd.vllm_server import VllmServer, VllmServerSpec, free_port

log = logging.getLogger(__name__)

SYSTEM = (
    "You are a careful assistant. Answer in short sentences, cite numbers exactly, never repeat the "
    "question, and keep every answer under twenty words unless asked for more detail. "
) * 5


def prompts() -> list[dict[str, Any]]:
    chat = [
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "List the first five prime numbers."},
            ]
        }
    ]
    # completions of token ids, exactly one token either side of the 128-token block boundaries
    comp = [{"prompt": [100 + (7 * i) % 5000 for i in range(n)]} for n in (127, 128, 129, 255, 256, 257, 383, 384, 385)]
    return chat + comp


def ask(client: httpx.Client, url: str, p: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": _model_dir(), "max_tokens": 8, "temperature": 0, **p}
    if "messages" in p:
        body.update(logprobs=True, top_logprobs=5)
        r = client.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        ch = r.json()["choices"][0]
        lp = [[(t["token"], t["logprob"]) for t in e["top_logprobs"]] for e in ch["logprobs"]["content"]]
        return {"text": ch["message"]["content"], "top": lp, "usage": r.json().get("usage")}
    body.update(logprobs=5)
    r = client.post(url + "/v1/completions", json=body)
    r.raise_for_status()
    ch = r.json()["choices"][0]
    lp = [sorted(d.items(), key=lambda kv: -kv[1]) for d in ch["logprobs"]["top_logprobs"]]
    return {"text": ch["text"], "top": lp, "usage": r.json().get("usage")}


def run_all(url: str) -> list[dict[str, Any]]:
    with httpx.Client(timeout=300) as c:
        return [ask(c, url, p) for p in prompts()]


def phase_pd(extra: list[str]) -> dict[str, Any]:
    c = LocalCluster(
        model=_model_dir(),
        n_prefill=1,
        n_decode=1,
        max_model_len=1024,
        extra_args=extra,
        connector_extra={"lease_s": 15.0},
    )
    try:
        c.start()
        c.wait_healthy(600)
        proxy = ProxyThread(c.instances())
        try:
            pd = run_all(proxy.url)
        finally:
            proxy.close()
        dec = next(s.server.url for s in c.servers if s.role == "decode")
        pre = next(s.server.url for s in c.servers if s.role == "prefill")
        with httpx.Client() as client:
            # prompt tokens decode loaded over the connector: proof the PD answers were PD (a failed load
            # would have been recomputed on decode, kv_load_failure_policy=recompute)
            loaded = metric(client, dec, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        log.info("decode loaded %d prompt tokens over the connector", loaded)
        return {"pd": pd, "decode_direct": run_all(dec), "prefill_direct": run_all(pre), "loaded": loaded}
    finally:
        c.stop()


def phase_plain(extra: list[str], cores: str | None) -> dict[str, Any]:
    if cores is None:
        c = LocalCluster(
            model=_model_dir(), n_prefill=0, n_decode=1, max_model_len=1024, connector=None, extra_args=extra
        )
        c.start()
        try:
            c.wait_healthy(600)
            return {"plain": run_all(c.servers[0].server.url)}
        finally:
            c.stop()
    spec = VllmServerSpec(
        model=_model_dir(), port=free_port(), cpu_cores=cores, pin_processes=True, max_model_len=1024, extra_args=extra
    )
    s = VllmServer(spec, log_path=Path("/tmp/pddiff-plain.log")).start()
    try:
        s.wait_healthy(600)
        return {f"plain_cores_{cores}": run_all(s.url)}
    finally:
        s.stop()


def compare(res: dict[str, Any]) -> None:
    names = [k for k in res if k != "loaded"]
    for i in range(len(res["pd"])):
        log.info("prompt %d (%s prompt tokens)", i, (res["pd"][i]["usage"] or {}).get("prompt_tokens"))
        for k in names:
            log.info("  %-18s %r", k, res[k][i]["text"])
        for k in names[1:]:
            a, b = res["pd"][i]["top"], res[k][i]["top"]
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x[0][0] != y[0][0]), None)
            if j is None:
                d = max(abs(x[0][1] - y[0][1]) for x, y in zip(a, b))
                log.info("  pd == %s: chosen tokens' logprobs differ by %.3g at most", k, d)
            else:
                log.info("  pd vs %s: token %d differs: pd top-2 %s, %s top-2 %s", k, j, a[j][:2], k, b[j][:2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["pd", "plain", "compare"], required=True)
    ap.add_argument("--plain-cores", default=None)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--out", required=True, nargs="+", help="result file (compare: the files to read)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.phase == "compare":
        res: dict[str, Any] = {}
        for f in a.out:
            res.update(json.loads(Path(f).read_text()))
        compare(res)
        return
    extra = [] if a.prefix_caching else ["--no-enable-prefix-caching"]
    res = phase_pd(extra) if a.phase == "pd" else phase_plain(extra, a.plain_cores)
    Path(a.out[0]).write_text(json.dumps(res))


if __name__ == "__main__":
    main()

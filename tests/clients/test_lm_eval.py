"""lm-eval's `local-completions` against a real server (`pytest -m interop`; skipped without lm-eval): the
shipped tokenizer folder loads offline through HF AutoTokenizer, lm-eval sends token-id prompts,
and the bits per byte it reports equal what the echo API gives for the same text."""
import math

import httpx
import pytest

from tests.helpers import ROOT, ServerProcess, make_checkpoint

pytest.importorskip("lm_eval")
pytestmark = [pytest.mark.interop, pytest.mark.slow]  # lm-eval's imports alone take seconds


def test_lm_eval_bits_per_byte_equals_the_echo_api(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)  # the task's data file is named relative to the repository
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    ckpt = make_checkpoint(tmp_path, "tiny-linear")
    srv = ServerProcess([str(ckpt)])
    try:
        out = lm_eval.simple_evaluate(
            model="local-completions", tasks=["local_text"],
            task_manager=TaskManager(include_path=str(ROOT / "benchmarks/peers/lm_eval_task")),
            model_args=f"model=linear,base_url={srv.url}/v1/completions,tokenizer={ckpt},max_length=4096")
        bpb = out["results"]["local_text"]["bits_per_byte,none"]
        text = (ROOT / "benchmarks/peers/lm_eval_task/sample.txt").read_text()
        tok = AutoTokenizer.from_pretrained(str(ckpt))
        ids = httpx.post(srv.url + "/tokenize", json={"prompt": text}).json()["tokens"]
        assert tok.encode(text) == ids and tok.decode([tok.bos_token_id]) == "<|endoftext|>"  # the document boundary
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [tok.bos_token_id] + ids, "max_tokens": 0,
                                                           "echo": True, "logprobs": 0}).json()
        nats = -sum(r["choices"][0]["logprobs"]["token_logprobs"][1:])
        assert bpb == pytest.approx(nats / math.log(2) / len(text.encode()), rel=1e-5)
    finally:
        srv.stop()

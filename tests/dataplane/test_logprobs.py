"""Log-probabilities end to end: `pdd serve` on the CPU with a DeepSeek-V3 checkpoint this test
writes (transformers' own, byte-level tokenizer beside it), read with plain HTTP, the official
`openai` SDK and lm-evaluation-harness, against transformers' ``log_softmax`` of the same
checkpoint.

The first generated token's numbers come from the prefill and the rest from the decode, the
prompt's from the prefill over chunks (``--chunk-tokens 16`` cuts the prompts here); P TP1 ->
D TP1 and P TP2/DCP2 -> D TP2/DCP2 must give the same numbers.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nixl  # noqa: F401  (the tier needs it; never skip)
import pytest
import torch
from model_fixtures import V3_GROUPED, write_v3_checkpoint
from runtime_fixtures import http
from test_pdd_serve import Serve

pytestmark = pytest.mark.dataplane

BLOCK = 16
TOL = 2e-4  # fp32: transformers and pdd sum in other orders
EOS = "\u0100"  # byte 0 in the byte-level alphabet: never in these texts
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPT = [(i * 37 + 11) % 256 for i in range(3 * BLOCK + 5)]  # 4 chunks of the prefill


def _write_tokenizer(path: Path) -> None:
    """A byte-level BPE of exactly the model's 256 ids (no merges): what transformers'
    AutoTokenizer (lm-eval) and the router (tokenizer.json) both load offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 512}))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("v3-logprobs")
    write_v3_checkpoint(path, V3_GROUPED, seed=11)
    _write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> Any:
    import transformers

    return transformers.DeepseekV3ForCausalLM.from_pretrained(ckpt).eval().float()


def _start(ckpt: Path, logs: Path, *layout: str) -> Serve:
    s = Serve(["--model", str(ckpt), "--block-size", str(BLOCK), "--chunk-tokens", str(BLOCK),
               *layout], logs)
    s.url = s.wait_ready()  # type: ignore[attr-defined]
    return s


@pytest.fixture(scope="module")
def serve(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    s = _start(ckpt, tmp_path_factory.mktemp("logs-tp1"))
    try:
        yield s.url  # type: ignore[attr-defined]
    finally:
        s.kill_all()


def _hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of transformers' logits over ``ids``: row i is the distribution of the
    token after position i."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = http("POST", url, body, timeout=120)
    assert status == 200, answer
    return answer  # type: ignore[no-any-return]


def _id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token[len("token_id:"):])


def _check_completion(hf: Any, prompt: list[int], choice: dict[str, Any], k: int,
                      echo: bool) -> None:
    """Every token's and every top entry's log-probability against transformers'."""
    gen = choice["token_ids"]
    lp = choice["logprobs"]
    ids = [_id(t) for t in lp["tokens"]]
    assert ids == (prompt + gen if echo else gen)
    ref = _hf_logprobs(hf, prompt + gen)
    first = 0 if echo else len(prompt)
    if echo:
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(max(first, 1), len(prompt) + len(gen)):
        row = ref[pos - 1]
        j = pos - first
        got = lp["token_logprobs"][j]
        assert abs(got - float(row[ids[j]])) < TOL, (pos, got, float(row[ids[j]]))
        top = {_id(t): v for t, v in lp["top_logprobs"][j].items()}
        want = torch.topk(row, k).values
        listed = sorted((v for t, v in top.items() if t != ids[j] or len(top) == k),
                        reverse=True)[:k]
        assert len(top) in (k, k + 1) and ids[j] in top
        assert torch.allclose(torch.tensor(listed), want, atol=TOL), (pos, listed, want)
        for t, v in top.items():
            assert abs(v - float(row[t])) < TOL


def test_completion_logprobs_equal_transformers_prompt_and_generated(serve: str,
                                                                     hf: Any) -> None:
    url = f"{serve}/v1/completions"
    # Greedy, then sampled at a low temperature: the numbers are the raw distribution's.
    for extra in ({"temperature": 0}, {"temperature": 0.6, "seed": 5, "top_k": 20}):
        body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 4, "echo": True,
                "return_tokens_as_token_ids": True, **extra}
        choice = _post(url, body)["choices"][0]
        assert len(choice["token_ids"]) == 6
        _check_completion(hf, PROMPT, choice, 4, echo=True)
        ref = _hf_logprobs(hf, PROMPT)
        if extra["temperature"] == 0:
            assert choice["token_ids"][0] == int(ref[-1].argmax())
    body = {"prompt": PROMPT[:20], "max_tokens": 5, "logprobs": 0, "temperature": 0,
            "return_tokens_as_token_ids": True}
    _check_completion(hf, PROMPT[:20], _post(url, body)["choices"][0], 0, echo=False)


def test_echo_with_max_tokens_0_is_the_prompt_alone_and_bypasses_the_prefix_cache(
        serve: str, hf: Any) -> None:
    url = f"{serve}/v1/completions"
    text = "The quick brown fox jumps over the lazy dog, twice over."
    plain = _post(url, {"prompt": text, "max_tokens": 1, "temperature": 0})  # caches it
    body = {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 2,
            "return_tokens_as_token_ids": True}
    for _ in range(2):
        answer = _post(url, body)
        choice = answer["choices"][0]
        assert choice["text"] == text and choice["token_ids"] == []
        assert choice["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 0
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert answer["pdd"]["decode"] is None  # no hand-off at all
        prompt = [_id(t) for t in choice["logprobs"]["tokens"]]
        assert len(prompt) == plain["usage"]["prompt_tokens"]
        _check_completion(hf, prompt, {**choice, "token_ids": []}, 2, echo=True)
    # vLLM's prompt_logprobs, beside echo
    got = _post(url, {"prompt": text, "max_tokens": 2, "prompt_logprobs": 1,
                      "temperature": 0})["choices"][0]["prompt_logprobs"]
    ref = _hf_logprobs(hf, prompt)
    assert got[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        mine = got[i][str(prompt[i])]
        assert abs(mine["logprob"] - float(ref[i - 1, prompt[i]])) < TOL
        assert mine["rank"] == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert not any("error" in e for e in events), events
    return events


def test_streamed_logprobs_equal_the_whole_answers(serve: str) -> None:
    body = {"prompt": PROMPT[:30], "max_tokens": 7, "logprobs": 3, "echo": True,
            "temperature": 0.8, "seed": 9, "return_tokens_as_token_ids": True}
    url = f"{serve}/v1/completions"
    whole = _post(url, body)["choices"][0]["logprobs"]
    events = _stream(url, body)
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"]
             and e["choices"][0]["logprobs"] is not None]
    joined = {k: [x for p in parts for x in p[k]] for k in whole}
    # The same tokens and offsets; the numbers within fp32 noise: the second request's decode
    # reuses KV the first left in its prefix cache, which the prefill computed in other chunks.
    assert {k: joined[k] for k in ("tokens", "text_offset")} == {
        k: whole[k] for k in ("tokens", "text_offset")}
    assert _close(_numbers(joined), _numbers(whole))
    # the echoed prompt comes first, in an event of its own
    assert events[0]["choices"][0]["token_ids"] == []
    assert len(events[0]["choices"][0]["logprobs"]["tokens"]) == 30

    chat = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 2, "temperature": 0.7, "seed": 4}
    url = f"{serve}/v1/chat/completions"
    whole = _post(url, chat)["choices"][0]["logprobs"]["content"]
    assert len(whole) == 6 and all(len(c["top_logprobs"]) == 2 for c in whole)
    streamed = [c for e in _stream(url, chat) if e["choices"]
                and e["choices"][0]["logprobs"] is not None
                for c in e["choices"][0]["logprobs"]["content"]]
    assert [c["token"] for c in streamed] == [c["token"] for c in whole]
    assert _close(_numbers({"content": streamed}), _numbers({"content": whole}))


def test_chat_logprobs_equal_transformers_and_the_openai_sdk_reads_them(
        serve: str, hf: Any, ckpt: Path) -> None:
    import openai
    import transformers

    client = openai.OpenAI(base_url=f"{serve}/v1", api_key="none")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Say something short."}]
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    prompt = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    out = client.chat.completions.create(model=model, messages=messages,  # type: ignore
                                         max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=3,
                                         extra_body={"return_tokens_as_token_ids": True})
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    gen = [_id(c.token) for c in content]
    ref = _hf_logprobs(hf, list(prompt) + gen)
    for j, c in enumerate(content):
        row = ref[len(prompt) - 1 + j]
        assert abs(c.logprob - float(row[gen[j]])) < TOL
        assert gen[j] == int(row.argmax())
        assert [_id(t.token) for t in c.top_logprobs] == torch.topk(row, 3).indices.tolist()
        assert bytes(c.bytes or []) == c.token.encode()
    stream = client.chat.completions.create(model=model, messages=messages,  # type: ignore
                                            max_tokens=5, temperature=0, logprobs=True,
                                            top_logprobs=3, stream=True,
                                            extra_body={"return_tokens_as_token_ids": True})
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content or []]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]

    done = client.completions.create(model=model, prompt=PROMPT[:25], max_tokens=3,
                                     temperature=0, logprobs=2, echo=True)
    lp = done.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.text_offset is not None
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == 28
    assert lp.text_offset == sorted(lp.text_offset)


def test_layouts_give_the_same_numbers(serve: str, ckpt: Path,
                                       tmp_path: Path) -> None:
    sharded = _start(ckpt, tmp_path / "logs", "--prefill-tp", "2", "--prefill-dcp", "2",
                     "--decode-tp", "2", "--decode-dcp", "2")
    try:
        bodies = [
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 5, "echo": True,
                                 "temperature": 0.7, "seed": 1,
                                 "return_tokens_as_token_ids": True}),
            ("/v1/completions", {"prompt": PROMPT[:40], "max_tokens": 0, "logprobs": 1,
                                 "echo": True, "return_tokens_as_token_ids": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}],
                                      "max_tokens": 6, "logprobs": True, "top_logprobs": 4,
                                      "temperature": 0, "return_tokens_as_token_ids": True}),
        ]
        for path, body in bodies:
            one = _post(serve + path, body)["choices"][0]
            two = _post(sharded.url + path, body)["choices"][0]  # type: ignore[attr-defined]
            assert one["token_ids"] == two["token_ids"]
            assert _close(_numbers(one["logprobs"]), _numbers(two["logprobs"])), path
    finally:
        sharded.kill_all()


def _close(a: list[tuple[str, float]], b: list[tuple[str, float]]) -> bool:
    """The same tokens with log-probabilities within fp32 tolerance."""
    return [t for t, _ in a] == [t for t, _ in b] and all(
        abs(x - y) < TOL for (_, x), (_, y) in zip(a, b, strict=True))


def _numbers(lp: dict[str, Any]) -> list[tuple[str, float]]:
    """Every (token, log-probability) of a choice's logprobs, in order, nulls left out."""
    if "content" in lp:
        return [(x["token"], x["logprob"]) for c in lp["content"]
                for x in [c, *c["top_logprobs"]]]
    out = [(t, v) for t, v in zip(lp["tokens"], lp["token_logprobs"], strict=True)
           if v is not None]
    for top in lp["top_logprobs"]:
        out += sorted((top or {}).items())
    return out


# ---------------------------------------------------------------- lm-evaluation-harness
LL_DOCS = [{"q": "The sky is", "choices": [" blue", " green", " loud"], "gold": 0},
           {"q": "Two plus two is", "choices": [" four", " five"], "gold": 0},
           {"q": "Fire is", "choices": [" hot", " cold", " wet"], "gold": 0}]
GEN_DOCS = [{"q": "Count: one, two,", "a": " three"}, {"q": "Colours: red, blue,", "a": " green"}]


def _tasks(root: Path) -> None:
    for name, docs in (("ll", LL_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "pdd_ll.yaml").write_text(f"""task: pdd_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'll.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
""")
    (root / "pdd_gen.yaml").write_text(f"""task: pdd_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")


def test_lm_eval_harness_log_likelihoods_equal_transformers(serve: str, hf: Any, ckpt: Path,
                                                            tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    import transformers
    from lm_eval.tasks import TaskManager

    _tasks(tmp_path)
    status, models = http("GET", f"{serve}/v1/models")
    assert status == 200, models
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": models["data"][0]["id"], "base_url": f"{serve}/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": str(ckpt),
                    "batch_size": 1, "max_length": 256, "num_concurrent": 1,
                    "max_retries": 1},
        tasks=["pdd_ll", "pdd_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, apply_chat_template=False, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0)
    assert out is not None
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    samples = out["samples"]["pdd_ll"]
    assert len(samples) == len(LL_DOCS)
    checked = 0
    for s in samples:
        doc = s["doc"]
        # lm-eval's own (context, continuation) pairs: the choice after its target delimiter
        pairs = s["arguments"]
        assert [c for _, c in pairs] == [" " + c for c in doc["choices"]]
        for (context, continuation), resp in zip(pairs, s["resps"], strict=True):
            ctx = tok(context).input_ids
            cont = tok(continuation).input_ids
            ref = _hf_logprobs(hf, ctx + cont)
            want = sum(float(ref[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
            greedy = all(int(ref[len(ctx) - 1 + j].argmax()) == t for j, t in enumerate(cont))
            got, is_greedy = resp[0]
            assert abs(got - want) < TOL * len(cont), (doc, continuation, got, want)
            assert is_greedy == greedy
            checked += 1
    assert checked == sum(len(d["choices"]) for d in LL_DOCS)
    gens = out["samples"]["pdd_gen"]
    assert len(gens) == len(GEN_DOCS)
    for s in gens:
        ids = tok(s["doc"]["q"]).input_ids
        text = ""
        for _ in range(8):  # transformers' greedy continuation, cut at the task's until
            nxt = int(_hf_logprobs(hf, ids)[-1].argmax())
            ids.append(nxt)
            text = tok.decode(ids[len(tok(s["doc"]["q"]).input_ids):])
            if "\n" in text or "." in text:
                break
        cut = min((text.index(u) for u in ("\n", ".") if u in text), default=len(text))
        assert s["resps"][0][0] == text[:cut]
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def _by_choice(events: list[dict[str, Any]], n: int) -> list[dict[str, list[Any]]]:
    """Each choice's streamed completion logprobs, its events' joined in order."""
    out: list[dict[str, list[Any]]] = [{} for _ in range(n)]
    for e in events:
        for c in e["choices"]:
            if c["logprobs"] is not None:
                for k, v in c["logprobs"].items():
                    out[c["index"]].setdefault(k, []).extend(v)
    return out


def test_each_of_n_choices_carries_its_own_logprobs_and_the_echoed_prompt(
        serve: str, hf: Any) -> None:
    url = f"{serve}/v1/completions"
    text_prompt = PROMPT[:26]
    base = {"prompt": text_prompt, "max_tokens": 5, "logprobs": 3, "echo": True,
            "return_tokens_as_token_ids": True}
    single = _post(url, {**base, "temperature": 0})["choices"][0]
    greedy = _post(url, {**base, "temperature": 0, "n": 3})["choices"]
    assert [c["index"] for c in greedy] == [0, 1, 2]
    for c in greedy:
        assert c["token_ids"] == single["token_ids"] and c["text"] == single["text"]
        assert c["logprobs"]["tokens"] == single["logprobs"]["tokens"]
        assert _close(_numbers(c["logprobs"]), _numbers(single["logprobs"]))
        _check_completion(hf, text_prompt, c, 3, echo=True)
    sampled = {**base, "temperature": 1.0, "seed": 7, "n": 3}
    choices = _post(url, sampled)["choices"]
    assert len({tuple(c["token_ids"]) for c in choices}) > 1  # the seeds differ by index
    for c in choices:  # each choice's numbers are of its own tokens
        _check_completion(hf, text_prompt, c, 3, echo=True)
    streamed = _by_choice(_stream(url, sampled), 3)
    for c, s in zip(choices, streamed, strict=True):
        assert s["tokens"] == c["logprobs"]["tokens"]
        assert s["text_offset"] == c["logprobs"]["text_offset"]
        assert _close(_numbers(s), _numbers(c["logprobs"]))
    # top_logprobs without echo, and a chat's choices
    plain = _post(url, {**base, "echo": False, "temperature": 0, "n": 2})["choices"]
    for c in plain:
        _check_completion(hf, text_prompt, c, 3, echo=False)
    chat = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 4,
            "logprobs": True, "top_logprobs": 2, "temperature": 0.9, "seed": 3, "n": 2,
            "ignore_eos": True}
    curl = f"{serve}/v1/chat/completions"
    whole = _post(curl, chat)["choices"]
    got: list[list[Any]] = [[], []]
    for e in _stream(curl, chat):
        for c in e["choices"]:
            if c.get("logprobs") is not None:
                got[c["index"]].extend(c["logprobs"]["content"])
    for c, s in zip(whole, got, strict=True):
        content = c["logprobs"]["content"]
        assert len(content) == len(c["token_ids"]) == 4
        assert [x["token"] for x in s] == [x["token"] for x in content]
        assert _close(_numbers({"content": s}), _numbers({"content": content}))


def test_echo_with_n_prepends_the_prompt_to_every_choice_streamed_and_not(serve: str) -> None:
    url = f"{serve}/v1/completions"
    text = "Echoed to every choice."
    body = {"prompt": text, "max_tokens": 3, "echo": True, "n": 3, "temperature": 1.0,
            "seed": 2, "logprobs": 1, "ignore_eos": True}
    whole = _post(url, body)["choices"]
    prompt_len = len(whole[0]["logprobs"]["tokens"]) - 3
    for c in whole:
        assert c["text"].startswith(text)
        assert c["logprobs"]["tokens"][:prompt_len] == whole[0]["logprobs"]["tokens"][:prompt_len]
        assert c["logprobs"]["token_logprobs"][0] is None
    events = _stream(url, body)
    texts = ["", "", ""]
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in whole]
    # the prompt's event of each choice comes before any generated token
    heads = [c for e in events[:3] for c in e["choices"]]
    assert sorted(c["index"] for c in heads) == [0, 1, 2]
    assert all(c["text"] == text and c["token_ids"] == [] for c in heads)
    # max_tokens 0: the prompt alone, n times
    zero = _post(url, {**body, "max_tokens": 0})["choices"]
    assert [c["text"] for c in zero] == [text] * 3

"""vLLM's request extras through `openm3 serve`: `include_stop_str_in_output` (Completions and Chat Completions,
whole and streamed), `truncate_prompt_tokens` (the prompt's last k tokens, -1: what the context limit leaves),
`bad_words` and Chat Completions' `add_generation_prompt` / `continue_final_message`, each against an answer built
another way
(the engine on the cut prompt, a Completions request on the rendered text) and with a 400 naming the field for a
request vLLM refuses too."""

from __future__ import annotations

import pytest

from openm3.data.chat import render_chat

from test_serve import LIMIT, NAME, client, events, greedy_ids, model, tok  # noqa: F401 - the fixtures


def post(client, path: str, **fields):
    return client.post(path, json={"model": NAME, "temperature": 0, **fields})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"], ids=["completions", "chat"])
def test_include_stop_str_in_output_keeps_the_stop_string(client, path):
    """The text ends with the stop string that ended it, whole and streamed; without the flag it ends before."""
    where = {"prompt": "The LORD said"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "The LORD said"}]}

    def text_of(body: dict) -> str:
        choice = body["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    full = text_of(post(client, path, max_tokens=16, **where).json())
    assert len(full) >= 6, f"the random model's text is too short to pick a stop string from: {full!r}"
    stop = full[3:5]
    cut = full[:full.find(stop)]
    plain = post(client, path, max_tokens=16, stop=stop, **where).json()
    kept = post(client, path, max_tokens=16, stop=stop, include_stop_str_in_output=True, **where).json()
    assert text_of(plain) == cut and text_of(kept) == cut + stop
    assert kept["choices"][0]["finish_reason"] == "stop" and kept["choices"][0]["stop_reason"] == stop
    chunks = events(post(client, path, max_tokens=16, stop=stop, include_stop_str_in_output=True, stream=True,
                         **where))
    deltas = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
              for c in chunks if c["choices"]]
    assert "".join(deltas) == cut + stop


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, model, tok):
    """k: the answer is the engine's greedy answer to the last k tokens alone, the usage counts k, echo shows the
    kept prompt; -1: as many as the context limit leaves beside max_tokens; a prompt shorter than k is whole."""
    prompt = tok.encode("In the beginning God created the heaven and the earth. And the earth was without form")
    assert len(prompt) > 12
    body = post(client, "/v1/completions", prompt=prompt, max_tokens=6, truncate_prompt_tokens=5, echo=True).json()
    want = greedy_ids(model, tok, prompt[-5:], 6)
    assert body["usage"]["prompt_tokens"] == 5
    assert body["choices"][0]["text"] == tok.decode(prompt[-5:]) + tok.decode(want)
    text = tok.decode(prompt)
    by_text = post(client, "/v1/completions", prompt=text, max_tokens=6, truncate_prompt_tokens=5).json()
    assert by_text["choices"][0]["text"] == tok.decode(want)
    whole = post(client, "/v1/completions", prompt=prompt, max_tokens=6, truncate_prompt_tokens=1000).json()
    assert whole["usage"]["prompt_tokens"] == len(prompt)

    long = (prompt * 20)[:200]  # over the 96-token limit: a 400 uncut
    assert post(client, "/v1/completions", prompt=long, max_tokens=10).status_code == 400
    fit = post(client, "/v1/completions", prompt=long, max_tokens=10, truncate_prompt_tokens=-1).json()
    assert fit["usage"]["prompt_tokens"] == LIMIT - 10
    chat = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "word " * 300}],
                max_tokens=4, truncate_prompt_tokens=-1).json()
    assert chat["usage"]["prompt_tokens"] == LIMIT - 4
    r = post(client, "/v1/completions", prompt=prompt, truncate_prompt_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_continue_final_message_continues_the_assistants_text(client, tok):
    """The answer continues the final assistant message: it equals a Completions answer to the conversation
    rendered with its generation prompt and that text after it, and holds only the continuation; with
    add_generation_prompt false alone the prompt has no assistant opening."""
    user = [{"role": "user", "content": "Name a colour."}]
    start = "My favourite colour is"
    body = post(client, "/v1/chat/completions", messages=user + [{"role": "assistant", "content": start}],
                continue_final_message=True, add_generation_prompt=False, max_tokens=8).json()
    rendered = render_chat(user, add_generation_prompt=True) + start
    want = post(client, "/v1/completions", prompt=rendered, max_tokens=8, stop_token_ids=[tok.eos_id]).json()
    assert body["choices"][0]["message"]["content"] == want["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == len(tok.encode(rendered))
    parts = post(client, "/v1/chat/completions", messages=user + [
        {"role": "assistant", "content": [{"type": "text", "text": "My favourite "}, {"type": "text",
                                                                                      "text": "colour is"}]}],
        continue_final_message=True, max_tokens=8).json()  # add_generation_prompt left at its default
    assert parts["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]

    bare = post(client, "/v1/chat/completions", messages=user, add_generation_prompt=False, max_tokens=2).json()
    assert bare["usage"]["prompt_tokens"] == len(tok.encode(render_chat(user, add_generation_prompt=False)))
    assert bare["usage"]["prompt_tokens"] < len(tok.encode(render_chat(user, add_generation_prompt=True)))

    for messages, extra in ((user + [{"role": "assistant", "content": start}], {"add_generation_prompt": True}),
                            (user, {})):
        r = post(client, "/v1/chat/completions", messages=messages, continue_final_message=True, **extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_bad_words_are_kept_out_of_the_answer(client, model, tok):
    """A word of the plain greedy answer as a bad word: the answer equals the engine's under a picker that bans
    the word's tokens as written and after a space, and no longer holds those tokens in a row."""
    from openm3.engine import generate
    from openm3.engine.penalties import Penalties, PenalizedPicker

    prompt = tok.encode("In the beginning God created")
    plain = post(client, "/v1/completions", prompt=prompt, max_tokens=12).json()["choices"][0]["text"]
    assert plain.split(), f"no word in {plain!r}"
    word = plain.split()[0]
    banned = tuple({tuple(tok.encode(word)), tuple(tok.encode(" " + word))})
    picker = PenalizedPicker(Penalties(bad_words=banned), prompt, [tok.eos_id])
    want = generate(model, [prompt], max_new_tokens=12, stop_tokens=[tok.eos_id], constraints=[picker])[0][0].tokens
    body = post(client, "/v1/completions", prompt=prompt, max_tokens=12, bad_words=[word]).json()
    assert body["choices"][0]["text"] == tok.decode([t for t in want if t != tok.eos_id]) != plain
    for ids in banned:
        assert all(tuple(want[i:i + len(ids)]) != ids for i in range(len(want)))
    r = post(client, "/v1/completions", prompt=prompt, bad_words=[""])
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"], ids=["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, path):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries prompt, completion
    and total tokens so far, counting up to the final usage chunk's; with include_usage alone only that chunk
    does."""
    where = {"prompt": "In the beginning"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "In the beginning"}]}
    final = None
    for continuous in (True, False):
        chunks = events(post(client, path, max_tokens=8, stream=True, **where, stream_options={
            "include_usage": True, "continuous_usage_stats": continuous}))
        body, last = chunks[:-1], chunks[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
        final = final or last["usage"]
        assert last["usage"] == final  # greedy: the same answer both times
        if not continuous:
            assert all("usage" not in c for c in body)
            continue
        counts = [c["usage"]["completion_tokens"] for c in body]
        assert all("usage" in c for c in body) and counts == sorted(counts) and counts[-1] == final["completion_tokens"]
        assert {c["usage"]["prompt_tokens"] for c in body} == {final["prompt_tokens"]}
        assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
                   for c in body)


def test_prompt_logprobs_report_each_prompt_tokens_logprob_rank_and_alternatives(client, tok):
    """vLLM's `prompt_logprobs` k: Completions put it on each choice, Chat Completions at the top level; null for
    the first token, then the prompt token (its log probability as echo + logprobs scores it, its rank) and the k
    most likely tokens (ranks 1..k, most likely first). An echoed prompt keeps its own number of alternatives;
    streaming is refused, as in vLLM."""
    ids = tok.encode("the cat sat on the mat and the dog")
    body = {"prompt": [ids], "max_tokens": 2, "prompt_logprobs": 3}
    choice = post(client, "/v1/completions", **body).json()["choices"][0]
    got = choice["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    echo = post(client, "/v1/completions", prompt=[ids], max_tokens=2, echo=True, logprobs=1).json()
    scored = echo["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]
    assert choice["logprobs"] is None and choice["text"] == echo["choices"][0]["text"][len(tok.decode(ids)):]
    for position, token, logprob in zip(got[1:], ids[1:], scored):
        mine = position[str(token)]
        assert mine["logprob"] == pytest.approx(logprob, abs=1e-5) and mine["rank"] >= 1
        assert mine["decoded_token"] == tok.decode([token])
        others = sorted((v["rank"], v["logprob"]) for k, v in position.items() if k != str(token) or v["rank"] <= 3)
        assert [r for r, _ in others] == [1, 2, 3][:len(others)] and len(position) in (3, 4)
        assert [lp for _, lp in others] == sorted((lp for _, lp in others), reverse=True)
        assert all(mine["logprob"] <= lp for r, lp in others if r < mine["rank"])
    # with echo + logprobs 1 beside it: the echoed prompt keeps one alternative per token
    both = post(client, "/v1/completions", **body, echo=True, logprobs=1).json()["choices"][0]
    assert both["prompt_logprobs"] == got
    assert all(len(top) == 1 for top in both["logprobs"]["top_logprobs"][1:len(ids)])
    # chat: once, at the top level, for the rendered prompt
    chat = post(client, "/v1/chat/completions", messages=[{"role": "user", "content": "hi there"}], max_tokens=2,
                n=2, prompt_logprobs=0).json()
    entries = chat["prompt_logprobs"]
    assert entries[0] is None and len(entries) > 3 and all(len(e) == 1 for e in entries[1:])
    assert all("prompt_logprobs" not in c for c in chat["choices"])
    r = post(client, "/v1/completions", **body, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert "not available with stream" in r.json()["error"]["message"]
    r = post(client, "/v1/completions", prompt="hi", prompt_logprobs=21)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"

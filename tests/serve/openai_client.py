"""PyPI's official `openai` client against `anchor-text serve` (base URL as the argument): a completion, the same
completion streamed (chunks and the end of the stream), the model list, a stream past the context window through a
sink-rolling KV buffer, and an error reply as the client reads it. Exit 0 when every check holds."""
import sys

import openai

base_url = sys.argv[1]
client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=120.0)

ids = [m.id for m in client.models.list().data]
assert "kjv-gpt2" in ids, f"models: {ids}"

c = client.completions.create(model="kjv-gpt2", prompt="In the beginning", max_tokens=12, temperature=0, seed=1)
assert c.object == "text_completion", c.object
assert len(c.choices) == 1, c.choices
assert len(c.choices[0].text) > 0, "empty completion"
assert c.usage.completion_tokens == 12, c.usage
assert c.choices[0].finish_reason == "length", c.choices[0].finish_reason

# The same request streamed: the chunks put together are the same text (greedy decoding).
stream = client.completions.create(model="kjv-gpt2", prompt="In the beginning", max_tokens=12, temperature=0, seed=1,
                                   stream=True)
text, chunks, finish = "", 0, None
for chunk in stream:
    chunks += 1
    text += chunk.choices[0].text
    finish = chunk.choices[0].finish_reason or finish
assert chunks >= 2, f"chunks: {chunks}"
assert text == c.choices[0].text, f"streamed {text!r} != {c.choices[0].text!r}"
assert finish == "length", finish

# Past the context window with a sink-rolling KV buffer (the model's n_positions is 256); the server's own fields go
# in extra_body, as the client documents for parameters it does not know.
long = client.completions.create(model="kjv-gpt2", prompt="And God said", max_tokens=300, temperature=0.8, seed=3,
                                 stream=True, extra_body={"kv": "sink:4,60", "positions": "reencode"})
long_text = "".join(chunk.choices[0].text for chunk in long)
assert len(long_text) > 300, f"long stream: {len(long_text)} chars"

# A bad request as the client sees it: a 400 whose message names the field.
try:
    client.completions.create(model="kjv-gpt2", prompt="x", max_tokens="many")
except openai.BadRequestError as e:
    assert e.status_code == 400, e.status_code
    assert "max_tokens: expected an integer" in str(e), str(e)
else:
    raise AssertionError("max_tokens 'many' was accepted")

print(f"openai client {openai.__version__}: ok ({chunks} chunks, {len(long_text)} chars past the window)")

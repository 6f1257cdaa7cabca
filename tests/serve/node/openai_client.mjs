// The official `openai` npm client against `anchor-text serve` (base URL from argv): a completion, a streamed
// completion (chunks and the end of the stream), the model list, and an error reply read as the client reads it.
import OpenAI from "openai";
import assert from "node:assert/strict";

const baseURL = process.argv[2];
const client = new OpenAI({ baseURL, apiKey: "not-needed", maxRetries: 0, timeout: 120000 });

const models = await client.models.list();
const ids = models.data.map((m) => m.id);
assert.ok(ids.includes("kjv-gpt2"), `models: ${ids}`);

const c = await client.completions.create({
  model: "kjv-gpt2", prompt: "In the beginning", max_tokens: 12, temperature: 0, seed: 1,
});
assert.equal(c.object, "text_completion");
assert.equal(c.choices.length, 1);
assert.ok(c.choices[0].text.length > 0, "empty completion");
assert.equal(c.usage.completion_tokens, 12);
assert.equal(c.choices[0].finish_reason, "length");

// The same request streamed: the chunks put together are the same text (greedy decoding).
const stream = await client.completions.create({
  model: "kjv-gpt2", prompt: "In the beginning", max_tokens: 12, temperature: 0, seed: 1, stream: true,
});
let text = "", chunks = 0, finish = null;
for await (const chunk of stream) {
  chunks++;
  text += chunk.choices[0].text;
  if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
}
assert.ok(chunks >= 2, `chunks: ${chunks}`);
assert.equal(text, c.choices[0].text);
assert.equal(finish, "length");

// Past the context window with a sink-rolling KV buffer (the model's n_positions is 256).
const long = await client.completions.create({
  model: "kjv-gpt2", prompt: "And God said", max_tokens: 300, temperature: 0.8, seed: 3,
  kv: "sink:4,60", positions: "reencode", stream: true,
});
let longText = "";
for await (const chunk of long) longText += chunk.choices[0].text;
assert.ok(longText.length > 300, `long stream: ${longText.length} chars`);

// A bad request as the client sees it: a 400 whose message names the field.
await assert.rejects(
  client.completions.create({ model: "kjv-gpt2", prompt: "x", max_tokens: "many" }),
  (e) => e.status === 400 && /max_tokens: expected an integer/.test(e.message),
);
console.log(`openai client: ok (${chunks} chunks, ${longText.length} chars past the window)`);

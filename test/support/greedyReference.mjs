// What the node-llama-cpp reference scripts (cpuReference.mjs, vulkanReference.mjs) share: the greedy run itself, with
// the settings swactor's side runs with (flash attention on, F16 KV, one thread, a 256-token context).

/** `count` greedy tokens after `text` (BOS first when the model has one), in a fresh context disposed after. */
export const greedy = async (model, text, count) => {
  const ctx = await model.createContext({ contextSize: 256, threads: 1, flashAttention: true, sequences: 1 })
  const seq = ctx.getSequence()
  const bos = model.tokens.bos
  const prompt = [...(bos === null ? [] : [bos]), ...model.tokenize(text)]
  const tokens = []
  for await (const t of seq.evaluate(prompt, { temperature: 0 })) {
    tokens.push(t)
    if (tokens.length >= count) break
  }
  await ctx.dispose()
  return { prompt, tokens }
}

// node-llama-cpp's side of bench/gpuDecode.ts, in a process of its own (its GPU build holds the device while it runs):
// node gpuDecodeReference.mjs GPU MODEL PROMPT N CONTEXT THREADS ROUNDS -> one JSON line
// {gpu, tokens, decodeTokensPerSecond, loadMillis}. Every block and the output head on the device (gpuLayers max),
// flash attention on, F16 KV, greedy. Decode tok/s as swactor's run summary counts it: the tokens after the first over
// the time from the first token's arrival to the last's; each round a fresh context, the best round counts.
import { getLlama, LlamaLogLevel } from "node-llama-cpp"

const [gpu, path, text, count, context, threads, rounds] = process.argv.slice(2)
const llama = await getLlama({ gpu, build: "never", logLevel: LlamaLogLevel.error })
const loadStart = performance.now()
const model = await llama.loadModel({ modelPath: path, gpuLayers: "max" })
const loadMillis = performance.now() - loadStart
const bos = model.tokens.bos
const prompt = [...(bos === null ? [] : [bos]), ...model.tokenize(text)]
let best = 0
let tokens = []
for (let round = 0; round < Number(rounds); round++) {
  const ctx = await model.createContext({
    contextSize: Number(context),
    threads: Number(threads),
    flashAttention: true,
    sequences: 1
  })
  const seq = ctx.getSequence()
  const got = []
  const at = []
  for await (const t of seq.evaluate(prompt, { temperature: 0 })) {
    got.push(t)
    at.push(performance.now())
    if (got.length >= Number(count)) break
  }
  const rate = ((got.length - 1) * 1000) / (at.at(-1) - at[0])
  if (rate > best) best = rate
  tokens = got
  await ctx.dispose()
}
console.log(JSON.stringify({ gpu: llama.gpu, tokens, decodeTokensPerSecond: best, loadMillis }))
await model.dispose()
await llama.dispose()

// node-llama-cpp's greedy run on its CPU build for this process's platform, in a process of its own (test/arm64 runs
// it under qemu-aarch64, where it loads @node-llama-cpp/linux-arm64): node cpuReference.mjs MODEL PROMPT N -> one JSON
// line {arch, gpu, prompt, tokens}. Flash attention on, F16 KV, one thread, a 256-token context: the settings
// swactor's side runs with. Under qemu-user without binfmt_misc, a child of this process cannot exec the arm64 Node
// binary: with SWACTOR_TEST_QEMU="QEMU SYSROOT", node-llama-cpp's binding test process (child_process.fork) is started
// through qemu as well.
import childProcess from "node:child_process"
import { syncBuiltinESMExports } from "node:module"

const qemu = process.env["SWACTOR_TEST_QEMU"]
if (qemu !== undefined && qemu !== "") {
  const [qemuPath, sysroot] = qemu.split(" ")
  const fork = childProcess.fork
  childProcess.fork = (modulePath, args, options) =>
    fork(modulePath, args, {
      ...options,
      execPath: qemuPath,
      execArgv: ["-L", sysroot, process.execPath, ...(options?.execArgv ?? process.execArgv)]
    })
  syncBuiltinESMExports()
}
const { getLlama, LlamaLogLevel } = await import("node-llama-cpp")

const [path, text, count] = process.argv.slice(2)
const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error })
const model = await llama.loadModel({ modelPath: path })
const ctx = await model.createContext({ contextSize: 256, threads: 1, flashAttention: true, sequences: 1 })
const seq = ctx.getSequence()
const bos = model.tokens.bos
const prompt = [...(bos === null ? [] : [bos]), ...model.tokenize(text)]
const tokens = []
for await (const t of seq.evaluate(prompt, { temperature: 0 })) {
  tokens.push(t)
  if (tokens.length >= Number(count)) break
}
console.log(JSON.stringify({ arch: process.arch, gpu: llama.gpu, prompt, tokens }))
await ctx.dispose()
await model.dispose()
await llama.dispose()
